"""Qwen2-VL and Qwen2.5-VL checkpoints (Qwen2VLForConditionalGeneration,
Qwen2_5_VLForConditionalGeneration): a ViT with a 2x2 patch merger (astrai.model.vision.
qwen2_vl) beside a Qwen2 language model whose rope is M-RoPE (mrope_section)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from astrai.config import ConfigError
from astrai.model.families.family import Family, VisionFamily, preprocessor_config
from astrai.model.vision.qwen2_vl import Qwen2VLVision
from astrai.model.vision.qwen2_vl_processor import Qwen2VLImageProcessor

# transformers' split where a config names none (a head of 128 dims)
DEFAULT_MROPE_SECTION = (16, 24, 24)


def _mrope(hf: dict[str, Any], decoder: Mapping[str, Any]) -> dict[str, Any]:
    """M-RoPE's split of the rotary frequencies over (temporal, height, width)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    section = params.get("mrope_section", DEFAULT_MROPE_SECTION)
    if hf.get("use_sliding_window"):
        raise ConfigError("use_sliding_window on a Qwen2-VL language model is not supported")
    return {"mrope_section": tuple(section)}


QWEN2_VL_TEXT = Family(
    "qwen2_vl_text",
    model_types=("qwen2_vl_text", "qwen2_5_vl_text"),
    settings={"attention_bias": True},
    hf_settings=_mrope,
    # transformers 4 spells M-RoPE as a rope_scaling of type "mrope" over the default rope.
    rope_type_aliases={"mrope": "default"},
)


def _build(hf: dict[str, Any], directory: Path) -> Qwen2VLVision:
    processor = Qwen2VLImageProcessor.from_hf(preprocessor_config(directory, "Qwen2-VL"))
    return Qwen2VLVision(hf, processor)


QWEN2_VL = VisionFamily(
    "qwen2_vl",
    model_types=("qwen2_vl", "qwen2_5_vl"),
    renames=(
        # transformers 5's own layout; the hub's checkpoints (transformers 4) name the
        # language model model.* and lm_head.* already, and the tower visual.*
        ("model.language_model.", "model."),
        ("model.visual.", "visual."),
    ),
    vision_prefixes=("visual.",),
    build=_build,
    text_model_types={"qwen2_vl": "qwen2_vl_text", "qwen2_5_vl": "qwen2_5_vl_text"},
)
