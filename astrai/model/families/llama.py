"""Llama and the families that keep its layout: Mistral (a sliding window in every layer) and
Mixtral (Mistral with experts). llama.cpp writes all three as GGUF architecture llama."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from astrai.model.families.family import Family
from astrai.model.families.hf_config import hf_experts, sliding_layers


def _mistral_window(hf: dict[str, Any], decoder: Mapping[str, Any]) -> dict[str, Any]:
    # transformers' Mistral slides in every layer, whatever layer_types says.
    return sliding_layers(hf.get("sliding_window"), None, decoder["max_len"])


def _mixtral_experts(hf: dict[str, Any], decoder: Mapping[str, Any]) -> dict[str, Any]:
    # Mixtral's router always renormalises; its experts are intermediate_size wide, and it
    # slides as Mistral does.
    experts = hf_experts(
        hf,
        decoder["max_len"],
        dim_expert=hf.get("intermediate_size"),
        norm_topk_prob=True,
        sliding=True,
    )
    return {"moe": experts}


LLAMA = Family(
    "llama",
    model_types=("llama",),
    architectures=("llama",),
    # llama.cpp's converter permutes attn_q and attn_k rows for its llama-style rope.
    permuted_rotary_rows=True,
)
MISTRAL = Family("mistral", model_types=("mistral",), hf_settings=_mistral_window)
MIXTRAL = Family("mixtral", model_types=("mixtral",), hf_settings=_mixtral_experts)
