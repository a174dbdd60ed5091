"""Gemma 2 and Gemma 3: GeGLU, embeddings scaled by sqrt(dim), a norm after each sublayer as
well as before it, (1 + w) norms, and sliding-window layers among full ones; and Gemma 3 with
images (Gemma3ForConditionalGeneration): a SigLIP tower and its pooling projector
(astrai.model.vision.gemma3) beside the Gemma 3 language model.

What llama.cpp's GGUF files do not hold is stated here once for both formats: the share of
sliding layers, Gemma 2's soft-cap defaults, Gemma 3's rope base on its sliding layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from astrai.config import LAYER_TYPES, ConfigError
from astrai.model.families.family import Family, VisionFamily, preprocessor_config
from astrai.model.families.gguf_metadata import GGUFMetadata
from astrai.model.families.hf_config import sliding_layers
from astrai.model.families.llava import LLAVA_LAYOUT_RENAMES, LLAVA_LAYOUT_VISION_PREFIXES
from astrai.model.families.tensor_names import GGUF_POST_NORM_LAYER_NAMES, HF_POST_NORM_LAYER_NAMES
from astrai.model.vision.gemma3 import Gemma3Vision
from astrai.model.vision.gemma3_processor import Gemma3ImageProcessor

GEMMA_SETTINGS = {"hidden_act": "gelu_tanh", "scale_embeddings": True, "post_norms": True}
# Gemma 2 slides in every other layer, Gemma 3 in 5 of every 6.
GEMMA2_SLIDING_PATTERN = 2
GEMMA3_SLIDING_PATTERN = 6
# Gemma 2's soft-caps of the attention logits and the final logits where a file has none.
GEMMA2_SOFTCAPS = (50.0, 30.0)
GEMMA3_LOCAL_ROPE_THETA = 10000.0
# llama.cpp's reading of the 27B models (known by their layer count): queries scaled by
# dim / n_heads, the others' by head_dim.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _layer_types(n_layers: int, pattern: int) -> list[str]:
    """Sliding layers but every pattern-th one, which attends fully."""
    return [LAYER_TYPES[(i + 1) % pattern != 0] for i in range(n_layers)]


def _hf_gemma(
    hf: dict[str, Any],
    decoder: Mapping[str, Any],
    pattern: int,
    softcaps: tuple[float | None, float | None],
) -> dict[str, Any]:
    """What a Gemma config.json changes beyond GEMMA_SETTINGS, layers sliding by pattern."""
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ConfigError(
            f"hidden_activation {activation!r} is not supported on {hf['model_type']}; astrai "
            "runs Gemma's GeGLU with the tanh approximation of GELU (gelu_pytorch_tanh)"
        )
    if hf.get("use_bidirectional_attention"):
        raise ConfigError(
            "use_bidirectional_attention=true (an embedding model) is not supported; astrai "
            "runs causal decoders"
        )
    layer_types = hf.get("layer_types") or _layer_types(decoder["n_layers"], pattern)
    return {
        "attention_scale": hf.get("query_pre_attn_scalar", 256) ** -0.5,
        "attn_logit_softcap": hf.get("attn_logit_softcapping", softcaps[0]),
        "final_logit_softcap": hf.get("final_logit_softcapping", softcaps[1]),
        **sliding_layers(hf.get("sliding_window"), layer_types, decoder["max_len"]),
    }


def _hf_gemma2(hf: dict[str, Any], decoder: Mapping[str, Any]) -> dict[str, Any]:
    return _hf_gemma(hf, decoder, GEMMA2_SLIDING_PATTERN, GEMMA2_SOFTCAPS)


def _hf_gemma3(hf: dict[str, Any], decoder: Mapping[str, Any]) -> dict[str, Any]:
    pattern = hf.get("sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
    return {
        **_hf_gemma(hf, decoder, pattern, (None, None)),
        "rope_local_theta": float(hf["rope_local_base_freq"]),
    }


def _gemma3_global_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """hf with the full-attention layers' rope in the place the shared reader reads it and
    rope_local_base_freq set: the sliding layers' base, whose rope must be plain."""
    params = hf.get("rope_parameters")
    if params is not None and isinstance(params.get("sliding_attention"), dict):
        local = params["sliding_attention"]
        if local.get("rope_type", "default") != "default":
            raise ConfigError(
                f"rope scaling {local['rope_type']!r} on Gemma 3's sliding layers is not "
                "supported; astrai scales the rope of its full-attention layers only"
            )
        return {
            **hf,
            "rope_parameters": {"rope_theta": 1e6, **params.get("full_attention", {})},
            "rope_local_base_freq": local.get("rope_theta", GEMMA3_LOCAL_ROPE_THETA),
        }
    # transformers 4 spelling: rope_theta (default 1e6 on Gemma 3) and rope_scaling at top level
    return {"rope_theta": 1e6, "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA, **hf}


def _gguf_gemma(metadata: GGUFMetadata, decoder: Mapping[str, Any], pattern: int) -> dict[str, Any]:
    """What a Gemma file changes beyond GEMMA_SETTINGS, layers sliding by pattern."""
    n_layers, window = decoder["n_layers"], metadata("attention.sliding_window", None)
    dim_per_head = decoder["dim"] // decoder["n_heads"]
    large = n_layers == GEMMA_27B_LAYERS[metadata.architecture]
    settings = {
        "attention_scale": (dim_per_head if large else decoder["head_dim"]) ** -0.5,
        "layer_types": _layer_types(n_layers, pattern),
    }
    if window and window < decoder["max_len"]:
        settings["sliding_window"] = window
    return settings


def _gguf_gemma2(metadata: GGUFMetadata, decoder: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **_gguf_gemma(metadata, decoder, GEMMA2_SLIDING_PATTERN),
        "attn_logit_softcap": metadata("attn_logit_softcapping", GEMMA2_SOFTCAPS[0]),
        "final_logit_softcap": metadata("final_logit_softcapping", GEMMA2_SOFTCAPS[1]),
    }


def _gguf_gemma3(metadata: GGUFMetadata, decoder: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **_gguf_gemma(metadata, decoder, GEMMA3_SLIDING_PATTERN),
        "rope_local_theta": GEMMA3_LOCAL_ROPE_THETA,
    }


GEMMA2 = Family(
    "gemma2",
    model_types=("gemma2",),
    architectures=("gemma2",),
    settings=GEMMA_SETTINGS,
    hf_settings=_hf_gemma2,
    gguf_settings=_gguf_gemma2,
    hf_layer_names=HF_POST_NORM_LAYER_NAMES,
    gguf_layer_names=GGUF_POST_NORM_LAYER_NAMES,
    unit_offset_norms=True,
)
GEMMA3 = Family(
    "gemma3",
    model_types=("gemma3_text",),
    architectures=("gemma3",),
    settings={**GEMMA_SETTINGS, "use_qk_norm": True},
    hf_settings=_hf_gemma3,
    gguf_settings=_gguf_gemma3,
    hf_respelled=_gemma3_global_rope,
    hf_layer_names=HF_POST_NORM_LAYER_NAMES,
    gguf_layer_names=GGUF_POST_NORM_LAYER_NAMES,
    unit_offset_norms=True,
)


def _build_vision(hf: dict[str, Any], directory: Path) -> Gemma3Vision:
    processor = Gemma3ImageProcessor.from_hf(preprocessor_config(directory, "Gemma 3"))
    return Gemma3Vision(hf, processor)


GEMMA3_VISION = VisionFamily(
    "gemma3",
    model_types=("gemma3",),
    renames=LLAVA_LAYOUT_RENAMES,  # the hub's layout (transformers 4) and transformers 5's
    vision_prefixes=LLAVA_LAYOUT_VISION_PREFIXES,
    build=_build_vision,
)
