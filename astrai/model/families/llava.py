"""LLaVA-1.5-style checkpoints (LlavaForConditionalGeneration): a CLIP tower and an MLP
projector (astrai.model.vision.llava) beside a language model of a family astrai runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from astrai.model.families.family import VisionFamily, preprocessor_config
from astrai.model.vision.image_processor import ClipImageProcessor
from astrai.model.vision.llava import LlavaVision


def _build(hf: dict[str, Any], directory: Path) -> LlavaVision:
    processor = ClipImageProcessor.from_hf(preprocessor_config(directory, "LLaVA"))
    return LlavaVision(hf, processor)


LLAVA = VisionFamily(
    "llava",
    model_types=("llava",),
    renames=(
        # transformers 4's layout (and transformers 5's save_pretrained)
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.vision_model.", "vision_tower."),
        # transformers 5's own layout
        ("model.language_model.", "model."),
        ("model.vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ),
    vision_prefixes=("vision_tower.", "multi_modal_projector."),
    build=_build,
)
