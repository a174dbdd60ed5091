"""The family table: one record per model family, and the lookups that pick a checkpoint's.

Adding a family is adding its record (a module here, listed in FAMILIES) and its tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import GGUFReader

from astrai.config import NATIVE_MODEL_TYPE, ConfigError, ModelConfig
from astrai.model.checkpoint import CheckpointError
from astrai.model.families.family import Family, VisionFamily
from astrai.model.families.gemma import GEMMA2, GEMMA3, GEMMA3_VISION
from astrai.model.families.gguf_config import read_gguf_config
from astrai.model.families.gguf_metadata import metadata_value
from astrai.model.families.granite import GRANITE
from astrai.model.families.hf_config import partial_rotary_factor, read_hf_config
from astrai.model.families.idefics3 import IDEFICS3
from astrai.model.families.llama import LLAMA, MISTRAL, MIXTRAL
from astrai.model.families.llava import LLAVA, LLAVA_NEXT
from astrai.model.families.olmo2 import OLMO2
from astrai.model.families.phi3 import PHI3
from astrai.model.families.qwen import QWEN2, QWEN2_MOE, QWEN3, QWEN3_MOE
from astrai.model.families.qwen2_vl import QWEN2_VL, QWEN2_VL_TEXT

# In the order error messages list them.
FAMILIES = (
    LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, MIXTRAL, QWEN2_MOE, QWEN3_MOE, PHI3, OLMO2,
    GRANITE, QWEN2_VL_TEXT,
)  # fmt: skip
VISION_FAMILIES = (LLAVA, LLAVA_NEXT, IDEFICS3, QWEN2_VL, GEMMA3_VISION)
HF_MODEL_TYPES = tuple(
    model_type for family in (*FAMILIES, *VISION_FAMILIES) for model_type in family.model_types
)
ARCHITECTURES = tuple(arch for family in FAMILIES for arch in family.architectures)


def hf_family(model_type: Any) -> Family:
    """The family of a config.json's model_type, or a ConfigError naming those astrai loads."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ConfigError(
        f"unsupported model_type {model_type!r}; astrai loads "
        f"{', '.join((NATIVE_MODEL_TYPE, *HF_MODEL_TYPES))}"
    )


def gguf_family(architecture: Any) -> Family:
    """The family of a GGUF general.architecture, or a CheckpointError naming those astrai
    loads."""
    for family in FAMILIES:
        if architecture in family.architectures:
            return family
    raise CheckpointError(
        f"unsupported GGUF architecture {architecture!r}; astrai loads {list(ARCHITECTURES)}"
    )


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json dict whose model_type is one of
    HF_MODEL_TYPES."""
    family = hf_family(hf.get("model_type"))
    partial = partial_rotary_factor(hf)
    if partial != 1.0 and not family.partial_rotary:
        partial_types = [t for f in FAMILIES if f.partial_rotary for t in f.model_types]
        raise ConfigError(
            f"partial rotary embedding (partial_rotary_factor={partial}) is supported on "
            f"{', '.join(partial_types)} only, where transformers applies it, not on "
            f"{hf['model_type']}"
        )
    return read_hf_config(hf, family)


def config_from_gguf(reader: GGUFReader, path: str | Path) -> ModelConfig:
    """The ModelConfig that the GGUF file at path (read by reader) describes in its metadata
    and its tensor list; what it refuses names the file."""
    try:
        architecture = gguf_architecture(reader)
        return read_gguf_config(reader, architecture, gguf_family(architecture))
    except (ConfigError, CheckpointError) as error:
        raise type(error)(f"GGUF file {path}: {error}") from None


def gguf_architecture(reader: GGUFReader) -> str | None:
    """general.architecture of a GGUF file (None if it names none)."""
    return metadata_value(reader, "general.architecture", None)


def read_config(path: str | Path) -> ModelConfig:
    """path/config.json as a ModelConfig: astrai's native format or a family's Hugging Face
    one."""
    return read_checkpoint_config(path)[0]


def read_checkpoint_config(path: str | Path) -> tuple[ModelConfig, Family | None]:
    """path/config.json as a ModelConfig, and the family whose Hugging Face checkpoint it
    describes (None: astrai's native format). A vision-language checkpoint's are those of its
    language model."""
    raw = _read_config_json(Path(path))
    if raw.get("model_type", NATIVE_MODEL_TYPE) == NATIVE_MODEL_TYPE:
        return ModelConfig.from_dict(raw), None
    vision = vision_family(raw.get("model_type"))
    if vision is not None:
        raw = vision.text_config(raw)
    family = hf_family(raw.get("model_type"))
    return config_from_hf(raw), family


def checkpoint_vision(path: str | Path) -> tuple[VisionFamily, dict[str, Any]] | None:
    """The vision-language family of the checkpoint at path and its config.json, or None for
    a language model alone."""
    raw = _read_config_json(Path(path))
    vision = vision_family(raw.get("model_type"))
    return None if vision is None else (vision, raw)


def vision_family(model_type: Any) -> VisionFamily | None:
    """The vision-language family of a config.json's model_type, None if it is none."""
    return next((f for f in VISION_FAMILIES if model_type in f.model_types), None)


def _read_config_json(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise FileNotFoundError(
            f"model directory {str(directory)!r} does not exist; pass a directory that "
            "holds config.json and the model's safetensors weights"
        )
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"no config.json in {str(directory)!r}; a model directory needs config.json "
            "(native astrai or Hugging Face) next to its safetensors weights"
        )
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{config_file} is not valid JSON: {error}") from error
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_file} must hold a JSON object, got {type(raw).__name__}")
    return raw
