"""The record of one model family: what astrai must know to build and load its checkpoints.

Every family astrai runs is the Llama decoder with a few differences. A record states them
once for both formats astrai reads (a Hugging Face config.json beside safetensors weights, and
a GGUF file): the names the family goes by, the ModelConfig fields it always sets, how each
format's settings translate into the others, its tensors' names, and the fix-ups its weights
need at load. The readers (hf_config, gguf_config and astrai.model.weights) apply a record;
they name no family.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astrai.config import ConfigError, ModelConfig
from astrai.model.families.gguf_metadata import GGUFMetadata
from astrai.model.families.tensor_names import (
    GGUF_LAYER_NAMES,
    GGUF_TOP_NAMES,
    HF_LAYER_NAMES,
    HF_TOP_NAMES,
    expert_template,
)

# (a checkpoint's settings: config.json's dict or a GGUF file's metadata, the Llama decoder's
# fields read from them so far) -> the family's own ModelConfig fields
HFSettings = Callable[[dict[str, Any], Mapping[str, Any]], dict[str, Any]]
GGUFSettings = Callable[[GGUFMetadata, Mapping[str, Any]], dict[str, Any]]


def no_settings(source: Any, decoder: Mapping[str, Any]) -> dict[str, Any]:
    """A family that reads nothing beyond the Llama decoder's settings."""
    return {}


def as_written(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json as the Llama decoder's reader takes it."""
    return hf


@dataclass(frozen=True)
class Family:
    """One model family.

    settings are ModelConfig fields that every checkpoint of the family has, whichever its
    format (Qwen3's q/k norm, Gemma's GeGLU); hf_settings and gguf_settings read what varies
    from checkpoint to checkpoint. hf_respelled rewrites a config.json whose rope settings
    the shared reader cannot take as they are (Gemma 3's per-layer-type rope). partial_rotary:
    the rope may turn part of each head (config.json's partial_rotary_factor, GGUF's
    rope.dimension_count), as transformers applies it on this family only. rope_type_aliases:
    config.json spellings of rope types that transformers reads as another type.

    Load fix-ups: unit_offset_norms, the RMSNorm weights w of config.json checkpoints scale by
    1 + w (llama.cpp's converter adds the 1 in GGUF files); permuted_rotary_rows, a GGUF file's
    q and k rows are permuted for llama.cpp's rope (undone at load).
    """

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    hf_settings: HFSettings = no_settings
    gguf_settings: GGUFSettings = no_settings
    hf_respelled: Callable[[dict[str, Any]], dict[str, Any]] = as_written
    hf_layer_names: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: HF_LAYER_NAMES)
    gguf_layer_names: Mapping[str, str] = field(default_factory=lambda: GGUF_LAYER_NAMES)
    partial_rotary: bool = False
    rope_type_aliases: Mapping[str, str] = field(default_factory=dict)
    unit_offset_norms: bool = False
    permuted_rotary_rows: bool = False

    def hf_tensors(
        self, config: ModelConfig, name: str, shape: tuple[int, ...]
    ) -> list[tuple[str, tuple[int, ...]]]:
        """The Hugging Face tensors (name, shape) that make up native tensor `name` of this
        shape, in the order they are concatenated along dim 0."""
        if name in HF_TOP_NAMES:
            return [(HF_TOP_NAMES[name], shape)]
        _, layer, suffix = name.split(".", 2)  # layers.N.suffix
        suffix, index = expert_template(suffix)
        hf_names = [
            f"model.layers.{layer}.{hf.format(e=index)}" for hf in self.hf_layer_names[suffix]
        ]
        if len(hf_names) == 1:
            rows = [shape[0]]
        elif suffix.startswith("attention.wqkv"):
            q_size = config.n_heads * config.head_dim
            kv_size = config.n_kv_heads * config.head_dim
            rows = [q_size, kv_size, kv_size]
        else:  # an MLP's gate and up projections, fused
            rows = [shape[0] // 2, shape[0] // 2]
        return [(hf, (n, *shape[1:])) for hf, n in zip(hf_names, rows, strict=True)]

    def gguf_tensors(
        self, config: ModelConfig, name: str, shape: tuple[int, ...]
    ) -> list[tuple[str, tuple[int, ...]]]:
        """The GGUF tensors (name, torch-order shape) that make up native tensor `name`: those
        of hf_tensors, as llama.cpp's converter names them."""
        return [(self._gguf_name(hf), part) for hf, part in self.hf_tensors(config, name, shape)]

    def _gguf_name(self, hf_name: str) -> str:
        if hf_name in GGUF_TOP_NAMES:
            return GGUF_TOP_NAMES[hf_name]
        _, _, layer, suffix = hf_name.split(".", 3)  # model.layers.N.suffix
        suffix, expert = expert_template(suffix)
        return f"blk.{layer}.{self.gguf_layer_names[suffix].format(e=expert)}"


@dataclass(frozen=True)
class VisionFamily:
    """A vision-language family: a language model of one of the families above, whose
    config.json nests it under text_config, with a vision module beside it.

    renames: (checkpoint prefix, the name it reads as) pairs that turn the checkpoint's tensor
    names into the language model's Hugging Face names and the vision module's own (the first
    that matches applies; transformers 4 and 5 lay the same model out differently).
    vision_prefixes: the names (after renames) of the vision module's tensors, which the
    language model's loader leaves to it. build makes the vision module of a config.json and
    the checkpoint directory (its preprocessor_config.json). text_model_types: the language
    model's model_type, by the checkpoint's, where config.json may keep the language model's
    settings at its top level instead of under text_config (Qwen2-VL as transformers 4 wrote
    it).
    """

    name: str
    model_types: tuple[str, ...]
    renames: tuple[tuple[str, str], ...]
    vision_prefixes: tuple[str, ...]
    build: Callable[[dict[str, Any], Path], Any]
    text_model_types: Mapping[str, str] = field(default_factory=dict)

    def text_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The language model's config.json, as a plain checkpoint of its family has it."""
        text = hf.get("text_config")
        if text is None and hf.get("model_type") in self.text_model_types:
            return {**hf, "model_type": self.text_model_types[hf["model_type"]]}
        if not isinstance(text, dict):
            raise ConfigError(
                f"config.json of model_type {hf.get('model_type')!r} has no text_config object; "
                "it needs the language model's settings there"
            )
        return text

    def tensor_name(self, name: str) -> str:
        """A checkpoint tensor's name as the loaders read it."""
        for prefix, renamed in self.renames:
            if name.startswith(prefix):
                return renamed + name[len(prefix) :]
        return name


PREPROCESSOR_FILE = "preprocessor_config.json"


def preprocessor_config(directory: Path, family: str) -> dict[str, Any]:
    """A vision-language checkpoint's image processor settings (preprocessor_config.json)."""
    path = directory / PREPROCESSOR_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no {PREPROCESSOR_FILE} in {str(directory)!r}; a {family} checkpoint needs its "
            "image processor's settings (save the model's processor with it)"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON: {error}") from error
