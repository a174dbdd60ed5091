"""A Hugging Face config.json as a ModelConfig: the Llama decoder's settings, which every
family shares, then the family record's own.

Settings the model cannot honour are refused with a ConfigError rather than dropped, because
ignoring them would give a model that runs but computes something else.
"""

from __future__ import annotations

import math
from typing import Any

from astrai.config import LAYER_TYPES, ROPE_SCALING_KEYS, ConfigError, ModelConfig, MoEConfig
from astrai.model.families.family import Family


def read_hf_config(hf: dict[str, Any], family: Family) -> ModelConfig:
    """The ModelConfig of config.json hf, of a model type of family."""
    model_type = hf["model_type"]

    def required(key: str) -> Any:
        if hf.get(key) is None:
            raise ConfigError(f"{model_type} config.json lacks required key {key!r}")
        return hf[key]

    dim = required("hidden_size")
    n_heads = required("num_attention_heads")
    n_layers = required("num_hidden_layers")
    max_len = required("max_position_embeddings")
    _refuse_unsupported(hf, family)
    hf = family.hf_respelled(hf)
    rope_theta, rope_scaling = _rope(hf, max_len, family)
    head_dim = hf.get("head_dim") or dim // n_heads
    if rope_scaling is not None and rope_scaling["rope_type"] == "dynamic":
        # Dynamic NTK is for contexts factor times max_position_embeddings.
        max_len = int(max_len * rope_scaling["factor"])
    decoder = {
        "vocab_size": required("vocab_size"),
        "dim": dim,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": hf.get("num_key_value_heads") or n_heads,
        "head_dim": head_dim,
        "dim_ffn": required("intermediate_size"),
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_len": max_len,
        "tie_weight": bool(hf.get("tie_word_embeddings", False)),
    }
    if family.partial_rotary:
        decoder["rotary_dim"] = int(head_dim * partial_rotary_factor(hf))
    return ModelConfig(**{**decoder, **family.settings, **family.hf_settings(hf, decoder)})


def _refuse_unsupported(hf: dict[str, Any], family: Family) -> None:
    """Raise ConfigError for any HF setting that would make astrai compute a different model."""
    # A family whose record sets the activation reads and checks its own.
    if "hidden_act" not in family.settings and hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported; astrai runs SwiGLU")
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported: astrai's MLP has no biases")
    # Qwen2 always has a q/k/v bias and no flag; elsewhere attention_bias also adds an o_proj bias.
    if not family.settings.get("attention_bias") and hf.get("attention_bias"):
        raise ConfigError(
            f"attention_bias=true on {hf['model_type']} adds an o_proj bias, which astrai does "
            "not implement; only Qwen2's q/k/v bias is supported"
        )
    if hf.get("quantization_config"):
        raise ConfigError("quantized checkpoints are not supported; use unquantized weights")


def partial_rotary_factor(hf: dict[str, Any]) -> float:
    """The share of each head's dims that the rope turns, as config.json spells it."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))


def _rope(hf: dict[str, Any], max_len: int, family: Family) -> tuple[float, dict | None]:
    """Read rope settings from transformers 5 (rope_parameters) or 4 (rope_theta, rope_scaling),
    with the defaults transformers fills in written out, so the scaling names every parameter."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise ConfigError("per-layer-type rope parameters are not supported")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = family.rope_type_aliases.get(rope_type, rope_type)
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_SCALING_KEYS:
        raise ConfigError(
            f"unsupported rope scaling type {rope_type!r}; astrai supports "
            f"{sorted(ROPE_SCALING_KEYS)} (or no scaling)"
        )
    if rope_type in ("llama3", "yarn", "longrope"):
        # As transformers does: a top-level original_max_position_embeddings wins.
        original = hf.get("original_max_position_embeddings")
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", max_len)
    if rope_type == "dynamic":
        params["original_max_position_embeddings"] = max_len  # what transformers scales from
    # The parameters that transformers derives where a config leaves them out
    derived = {
        "yarn": ("attention_factor", "beta_fast", "beta_slow", "truncate"),
        "longrope": ("attention_factor",),
    }.get(rope_type, ())
    missing = [
        k for k in ROPE_SCALING_KEYS[rope_type] if k not in derived and params.get(k) is None
    ]
    if missing:
        raise ConfigError(f"rope scaling of type {rope_type!r} lacks {missing}")
    if rope_type == "yarn":
        params.update(_yarn_defaults(params))
    if rope_type == "longrope":
        params["attention_factor"] = _longrope_attention_factor(params, max_len)
    scaling = {"rope_type": rope_type}
    scaling.update({key: params[key] for key in ROPE_SCALING_KEYS[rope_type]})
    return theta, scaling


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context factor times longer (its paper's eq. 21)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_defaults(params: dict[str, Any]) -> dict[str, Any]:
    """YaRN's optional parameters, missing or null, as transformers fills them in."""
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        factor, mscale, mscale_all_dim = (
            params.get(k) for k in ("factor", "mscale", "mscale_all_dim")
        )
        attention_factor = (
            float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
            if mscale and mscale_all_dim
            else _yarn_mscale(factor)
        )
    return {
        "attention_factor": attention_factor,
        "beta_fast": params.get("beta_fast") or 32,
        "beta_slow": params.get("beta_slow") or 1,
        "truncate": bool(params.get("truncate", True)),
    }


def _longrope_attention_factor(params: dict[str, Any], max_len: int) -> float:
    """LongRoPE's attention factor: the config's, else transformers' default from how many
    times the original context max_len is."""
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    factor = max_len / original if factor is None else factor
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def sliding_layers(
    window: int | None, layer_types: list[str] | None, max_len: int
) -> dict[str, Any]:
    """sliding_window and layer_types as transformers derives them: none where no layer
    slides, no window where it is no shorter than the context (the layer types stay: Gemma 3's
    sliding layers keep their own rope). layer_types None: every layer slides."""
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ConfigError(f"unsupported attention layer types {unknown}")
        if "sliding_attention" not in layer_types:
            return {}
    shorter = window is not None and window < max_len
    return {"sliding_window": window if shorter else None, "layer_types": layer_types}


def hf_experts(
    hf: dict[str, Any],
    max_len: int,
    *,
    dim_expert: int | None,
    norm_topk_prob: bool,
    sliding: bool,
    dim_shared_expert: int | None = None,
) -> MoEConfig | None:
    """The experts of a mixture-of-experts config (None if it has none), the family saying how
    wide each is, whether the router renormalises, whether a window applies and the shared
    expert's width."""
    # transformers reads either name on Mixtral and Qwen3-MoE (Qwen2-MoE: num_experts).
    n_experts = hf.get("num_experts", hf.get("num_local_experts"))
    window = hf.get("sliding_window")
    if sliding and window and window < max_len:
        raise ConfigError(
            f"sliding_window={window} on {hf['model_type']} is not supported: astrai's "
            "sliding-window attention does not cover mixture-of-experts models yet"
        )
    if n_experts == 0:  # transformers then builds every layer dense
        return None
    return MoEConfig(
        n_experts=n_experts,
        n_experts_per_token=hf.get("num_experts_per_tok"),
        dim_expert=dim_expert,
        norm_topk_prob=norm_topk_prob,
        dim_shared_expert=dim_shared_expert,
        sparse_step=hf.get("decoder_sparse_step", 1),
        dense_layers=hf.get("mlp_only_layers") or (),
    )
