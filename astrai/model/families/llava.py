"""LLaVA-1.5-style checkpoints (LlavaForConditionalGeneration): a CLIP tower and an MLP
projector (astrai.model.vision.llava) beside a language model of a family astrai runs; and
LLaVA-NeXT's (LlavaNextForConditionalGeneration), the same run on the tiles of each image
(astrai.model.vision.llava_next)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from astrai.model.families.family import VisionFamily, preprocessor_config
from astrai.model.vision.image_processor import ClipImageProcessor
from astrai.model.vision.llava import LlavaVision
from astrai.model.vision.llava_next import LlavaNextVision
from astrai.model.vision.llava_next_processor import LlavaNextImageProcessor


def _build(hf: dict[str, Any], directory: Path) -> LlavaVision:
    processor = ClipImageProcessor.from_hf(preprocessor_config(directory, "LLaVA"))
    return LlavaVision(hf, processor)


def _build_next(hf: dict[str, Any], directory: Path) -> LlavaNextVision:
    processor = LlavaNextImageProcessor.from_hf(preprocessor_config(directory, "LLaVA-NeXT"))
    return LlavaNextVision(hf, processor)


# The layout of LLaVA's checkpoints, which other vision-language families share (Gemma 3's).
LLAVA_LAYOUT_RENAMES = (
    # transformers 4's layout (and transformers 5's save_pretrained)
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.vision_model.", "vision_tower."),
    # transformers 5's own layout
    ("model.language_model.", "model."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
LLAVA_LAYOUT_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")

LLAVA = VisionFamily(
    "llava",
    model_types=("llava",),
    renames=LLAVA_LAYOUT_RENAMES,
    vision_prefixes=LLAVA_LAYOUT_VISION_PREFIXES,
    build=_build,
)

LLAVA_NEXT = VisionFamily(
    "llava_next",
    model_types=("llava_next",),
    renames=(*LLAVA_LAYOUT_RENAMES, ("model.image_newline", "image_newline")),
    vision_prefixes=(*LLAVA_LAYOUT_VISION_PREFIXES, "image_newline"),
    build=_build_next,
)
