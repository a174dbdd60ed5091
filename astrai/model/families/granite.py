"""Granite: Llama with four multipliers (embeddings, attention scores, each sublayer's output
before its residual add, and the logits' divisor)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from astrai.model.families.family import Family
from astrai.model.families.gguf_metadata import GGUFMetadata


def _hf_multipliers(hf: dict[str, Any], decoder: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "embedding_multiplier": hf.get("embedding_multiplier", 1.0),
        "attention_scale": hf.get("attention_multiplier", 1.0),
        "residual_multiplier": hf.get("residual_multiplier", 1.0),
        "logits_scaling": hf.get("logits_scaling", 1.0),
    }


def _gguf_multipliers(metadata: GGUFMetadata, decoder: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "embedding_multiplier": metadata("embedding_scale", 1.0),
        "attention_scale": metadata("attention.scale", None),
        "residual_multiplier": metadata("residual_scale", 1.0),
        "logits_scaling": metadata("logit_scale", 1.0),
    }


GRANITE = Family(
    "granite",
    model_types=("granite",),
    architectures=("granite",),
    hf_settings=_hf_multipliers,
    gguf_settings=_gguf_multipliers,
    # llama.cpp's converter permutes attn_q and attn_k rows for its llama-style rope.
    permuted_rotary_rows=True,
)
