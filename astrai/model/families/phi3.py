"""Phi-3 (and Phi-3.5, Phi-4-mini): q/k/v and gate/up stored fused, LongRoPE, a rope over part
of each head (Phi-4-mini), and a sliding window in every layer (Phi-3-mini-4k)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from astrai.model.families.family import Family
from astrai.model.families.gguf_metadata import GGUFMetadata
from astrai.model.families.tensor_names import GGUF_LAYER_NAMES, HF_LAYER_NAMES

# Phi-3 checkpoints hold q/k/v and gate/up fused, in astrai's order.
HF_FUSED_LAYER_NAMES = {
    **HF_LAYER_NAMES,
    "attention.wqkv.weight": ("self_attn.qkv_proj.weight",),
    "feed_forward.w13.weight": ("mlp.gate_up_proj.weight",),
}
GGUF_FUSED_LAYER_NAMES = {
    **GGUF_LAYER_NAMES,
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
# Spellings of rope types that transformers reads as longrope.
PHI3_ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}


def _every_layer_slides(window: int | None, max_len: int) -> dict[str, Any]:
    """A window in every layer, as on Mistral, where it is shorter than the context."""
    return {} if not window or window >= max_len else {"sliding_window": window}


def _hf_window(hf: dict[str, Any], decoder: Mapping[str, Any]) -> dict[str, Any]:
    return _every_layer_slides(hf.get("sliding_window"), decoder["max_len"])


def _gguf_window(metadata: GGUFMetadata, decoder: Mapping[str, Any]) -> dict[str, Any]:
    return _every_layer_slides(metadata("attention.sliding_window", None), decoder["max_len"])


PHI3 = Family(
    "phi3",
    model_types=("phi3",),
    architectures=("phi3",),
    hf_settings=_hf_window,
    gguf_settings=_gguf_window,
    hf_layer_names=HF_FUSED_LAYER_NAMES,
    gguf_layer_names=GGUF_FUSED_LAYER_NAMES,
    partial_rotary=True,
    rope_type_aliases=PHI3_ROPE_ALIASES,
)
