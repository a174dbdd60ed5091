"""Idefics3 and SmolVLM checkpoints (Idefics3ForConditionalGeneration,
SmolVLMForConditionalGeneration): a SigLIP tower and a pixel-shuffle connector
(astrai.model.vision.idefics3) beside a Llama language model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from astrai.model.families.family import VisionFamily, preprocessor_config
from astrai.model.vision.idefics3 import Idefics3Vision
from astrai.model.vision.idefics3_processor import Idefics3ImageProcessor


def _build(hf: dict[str, Any], directory: Path) -> Idefics3Vision:
    processor = Idefics3ImageProcessor.from_hf(preprocessor_config(directory, "Idefics3"))
    return Idefics3Vision(hf, processor)


IDEFICS3 = VisionFamily(
    "idefics3",
    model_types=("idefics3", "smolvlm"),
    renames=(
        ("model.text_model.", "model."),
        ("model.vision_model.", "vision_model."),
        ("model.connector.", "connector."),
    ),
    vision_prefixes=("vision_model.", "connector."),
    build=_build,
)
