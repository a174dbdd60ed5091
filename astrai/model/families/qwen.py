"""Qwen2 (a q/k/v bias), Qwen3 (a q/k norm per head) and their mixture-of-experts kin."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from astrai.config import LAYER_TYPES, ConfigError
from astrai.model.families.family import Family
from astrai.model.families.gguf_config import gguf_experts
from astrai.model.families.gguf_metadata import GGUFMetadata
from astrai.model.families.hf_config import hf_experts, sliding_layers


def _sliding_window(hf: dict[str, Any], decoder: Mapping[str, Any]) -> dict[str, Any]:
    """A window in the layers from max_window_layers on, where use_sliding_window says so."""
    if not hf.get("use_sliding_window"):
        return {}
    first_sliding = hf.get("max_window_layers", 28)  # transformers' default
    layer_types = hf.get("layer_types") or [
        LAYER_TYPES[i >= first_sliding] for i in range(decoder["n_layers"])
    ]
    return sliding_layers(hf.get("sliding_window"), layer_types, decoder["max_len"])


def _qwen_experts(hf: dict[str, Any], decoder: Mapping[str, Any], **shared: Any) -> dict:
    experts = hf_experts(
        hf,
        decoder["max_len"],
        dim_expert=hf.get("moe_intermediate_size"),
        norm_topk_prob=bool(hf.get("norm_topk_prob")),
        sliding=hf.get("use_sliding_window"),
        **shared,
    )
    return {"moe": experts}


def _qwen2_moe(hf: dict[str, Any], decoder: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE's experts beside a shared expert every token runs, and its q/k/v bias, which
    config.json may turn off."""
    shared = hf.get("shared_expert_intermediate_size")
    experts = _qwen_experts(hf, decoder, dim_shared_expert=shared)
    if experts["moe"] is not None and shared is None:
        raise ConfigError("qwen2_moe config.json lacks shared_expert_intermediate_size")
    return {"attention_bias": hf.get("qkv_bias", True), **experts}


def _qwen2_moe_gguf(metadata: GGUFMetadata, decoder: Mapping[str, Any]) -> dict[str, Any]:
    # llama.cpp renormalises the chosen experts' weights on every architecture but this one.
    return {"attention_bias": True, "moe": gguf_experts(metadata, renormalise=False)}


QWEN2 = Family(
    "qwen2",
    model_types=("qwen2",),
    architectures=("qwen2",),
    settings={"attention_bias": True},
    hf_settings=_sliding_window,
)
QWEN3 = Family(
    "qwen3",
    model_types=("qwen3",),
    architectures=("qwen3",),
    settings={"use_qk_norm": True},
    hf_settings=_sliding_window,
)
QWEN2_MOE = Family(
    "qwen2_moe",
    model_types=("qwen2_moe",),
    architectures=("qwen2moe",),
    hf_settings=_qwen2_moe,
    gguf_settings=_qwen2_moe_gguf,
)
QWEN3_MOE = Family(
    "qwen3_moe",
    model_types=("qwen3_moe",),
    architectures=("qwen3moe",),
    settings={"use_qk_norm": True},
    hf_settings=_qwen_experts,
)
