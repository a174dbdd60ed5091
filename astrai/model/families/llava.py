"""LLaVA-1.5-style checkpoints (LlavaForConditionalGeneration): a CLIP tower and an MLP
projector (astrai.model.vision.llava) beside a language model of a family astrai runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from astrai.config import ConfigError
from astrai.model.families.family import VisionFamily
from astrai.model.vision.image_processor import ClipImageProcessor
from astrai.model.vision.llava import LlavaVision

PREPROCESSOR_FILE = "preprocessor_config.json"


def _build(hf: dict[str, Any], directory: Path) -> LlavaVision:
    path = directory / PREPROCESSOR_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no {PREPROCESSOR_FILE} in {str(directory)!r}; a LLaVA checkpoint needs its image "
            "processor's settings (save the model's processor with it)"
        )
    try:
        processor = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON: {error}") from error
    return LlavaVision(hf, ClipImageProcessor.from_hf(processor))


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
