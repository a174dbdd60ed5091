"""A GGUF file's metadata as a ModelConfig: the Llama decoder's keys, which every
architecture shares, then the family record's own."""

from __future__ import annotations

import re
from typing import Any

from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize as decode_blocks

from astrai.config import ConfigError, ModelConfig, MoEConfig
from astrai.model.families.family import Family
from astrai.model.families.gguf_metadata import GGUFMetadata

# Llama 3.1's rope scaling as llama.cpp stores it: a divisor for each rotary frequency.
ROPE_FREQS = "rope_freqs.weight"
# Phi-3's LongRoPE divisors within and past the original context.
LONGROPE_FACTORS = {
    "short_factor": "rope_factors_short.weight",
    "long_factor": "rope_factors_long.weight",
}


# The architecture's keys that count or size something, by the least value each may hold where
# present (0: there are none). But for the counts of blocks (checked against the blocks present)
# and of positions, none may be larger than the widest dim of the file's tensors, which the
# model is made of.
SIZES = {
    "block_count": 1, "context_length": 1, "attention.sliding_window": 0, "expert_count": 0,
    **dict.fromkeys((
        "embedding_length", "feed_forward_length", "attention.head_count",
        "attention.head_count_kv", "attention.key_length", "attention.value_length",
        "rope.dimension_count", "expert_used_count", "expert_feed_forward_length",
        "expert_shared_feed_forward_length", "vocab_size",
    ), 1),
}  # fmt: skip
UNBOUNDED_SIZES = ("block_count", "context_length", "attention.sliding_window")
INTEGER_TYPES = frozenset(
    GGUFValueType[name]
    for name in ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64")
)
LAYER = re.compile(r"blk\.(\d+)\.")


def read_gguf_config(reader: GGUFReader, architecture: str, family: Family) -> ModelConfig:
    """The ModelConfig that a GGUF file of this architecture (one of family's) describes in its
    metadata and its tensor list."""
    metadata = GGUFMetadata(reader, architecture)
    check_architecture_numbers(metadata)
    dim = metadata("embedding_length")
    n_heads = metadata("attention.head_count")
    # Where the rope may turn part of each head, rope.dimension_count is no head size.
    head_dim = metadata("attention.key_length", None)
    head_dim = head_dim or (not family.partial_rotary and metadata("rope.dimension_count", None))
    if not head_dim and dim % n_heads:
        raise ConfigError(
            f"{architecture}.embedding_length = {dim} is not a multiple of "
            f"{architecture}.attention.head_count = {n_heads}: without "
            f"{architecture}.attention.key_length the head size is their quotient"
        )
    head_dim = head_dim or dim // n_heads
    same_size = (
        "attention.value_length",
        *(() if family.partial_rotary else ("rope.dimension_count",)),
    )
    for other in same_size:
        if metadata(other, head_dim) != head_dim:
            raise ConfigError(
                f"{architecture}.{other} = {metadata(other)} differs from the head size "
                f"{head_dim}: partial rotary embedding and value heads of another size are not "
                "supported"
            )
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    decoder = {
        "vocab_size": len(tokens.data) if tokens is not None else metadata("vocab_size"),
        "dim": dim,
        "n_layers": metadata("block_count"),
        "n_heads": n_heads,
        "n_kv_heads": metadata("attention.head_count_kv", None) or n_heads,
        "head_dim": head_dim,
        "dim_ffn": metadata("feed_forward_length"),
        "norm_eps": metadata("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": metadata("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(metadata),
        "max_len": metadata("context_length"),
        "tie_weight": "output.weight" not in metadata.tensor_names,
        "moe": gguf_experts(metadata),
    }
    if family.partial_rotary:
        decoder["rotary_dim"] = metadata("rope.dimension_count", None)
    return ModelConfig(**{**decoder, **family.settings, **family.gguf_settings(metadata, decoder)})


def check_architecture_numbers(metadata: GGUFMetadata) -> None:
    """Raise a ConfigError naming the key unless the sizes the metadata states are integers that
    agree with each other and with the tensors: each within its bounds (SIZES), the heads a
    multiple of the KV heads, no more experts used than there are, and block_count the number
    of blocks whose tensors the file holds (a file that claims a million must not build them).
    The model's shapes are checked against the tensors' once it is built on the meta device."""
    prefix = metadata.architecture
    tensors = metadata.reader.tensors
    widest = max((int(n) for tensor in tensors for n in tensor.shape), default=0)
    for key, least in SIZES.items():
        field = metadata.reader.fields.get(f"{prefix}.{key}")
        if field is None:
            continue
        if len(field.types) != 1 or field.types[0] not in INTEGER_TYPES:
            kind = "/".join(t.name for t in field.types)
            raise ConfigError(f"{prefix}.{key} is a {kind}, expected an integer")
        value = metadata(key)
        if value < least or (key not in UNBOUNDED_SIZES and value > widest):
            most = "" if key in UNBOUNDED_SIZES else f" to {widest} (the widest tensor dim)"
            raise ConfigError(f"{prefix}.{key} = {value}, expected {least}{most}")
    for required in ("embedding_length", "block_count", "attention.head_count"):
        metadata(required)
    n_heads = metadata("attention.head_count")
    n_kv_heads = metadata("attention.head_count_kv", n_heads)
    if n_heads % n_kv_heads:
        raise ConfigError(
            f"{prefix}.attention.head_count = {n_heads} is not a multiple of "
            f"{prefix}.attention.head_count_kv = {n_kv_heads}"
        )
    if metadata("expert_used_count", 0) > metadata("expert_count", 0):
        raise ConfigError(
            f"{prefix}.expert_used_count = {metadata('expert_used_count')} exceeds "
            f"{prefix}.expert_count = {metadata('expert_count', 0)}"
        )
    blocks = {int(match[1]) for t in tensors if (match := LAYER.match(t.name))}
    n_blocks = metadata("block_count")
    if len(blocks) != n_blocks or max(blocks, default=-1) != n_blocks - 1:
        absent = next(i for i in range(len(blocks) + 1) if i not in blocks)
        held = f"blocks 0 to {absent - 1}" if absent else "no block 0"
        beyond = sorted(b for b in blocks if b > absent)[:1]
        raise ConfigError(
            f"{prefix}.block_count = {n_blocks}, but the file holds the tensors of {held}"
            + (f" and of block {beyond[0]}" if beyond else "")
        )


def gguf_experts(metadata: GGUFMetadata, renormalise: bool = True) -> MoEConfig | None:
    """The experts a file's metadata describes, None if it has none. A layer is sparse if the
    file holds its router; the chosen experts' weights are renormalised where the file says
    so, else as the family does by default (renormalise)."""
    n_experts = metadata("expert_count", 0)
    if not n_experts:
        return None
    dense = [
        i
        for i in range(metadata("block_count"))
        if f"blk.{i}.ffn_gate_inp.weight" not in metadata.tensor_names
    ]
    return MoEConfig(
        n_experts=n_experts,
        n_experts_per_token=metadata("expert_used_count"),
        dim_expert=metadata("expert_feed_forward_length", None) or metadata("feed_forward_length"),
        norm_topk_prob=metadata("expert_weights_norm", renormalise),
        dim_shared_expert=metadata("expert_shared_feed_forward_length", None),
        dense_layers=dense,
    )


def _rope_scaling(metadata: GGUFMetadata) -> dict | None:
    scaling = metadata("rope.scaling.type", "none")
    factor = metadata("rope.scaling.factor", None)
    if factor is None:  # older converters wrote only this key, for linear scaling
        factor = metadata("rope.scale_linear", None)
        scaling = "linear" if factor not in (None, 1.0) else scaling
    tensors = {
        t.name: t
        for t in metadata.reader.tensors
        if t.name in (ROPE_FREQS, *LONGROPE_FACTORS.values())
    }
    if LONGROPE_FACTORS["short_factor"] in tensors:  # Phi-3
        return {
            "rope_type": "longrope",
            **{key: _vector(tensors[name]) for key, name in LONGROPE_FACTORS.items()},
            "original_max_position_embeddings": metadata("rope.scaling.original_context_length"),
            "attention_factor": metadata("rope.scaling.attn_factor", 1.0),
        }
    frequency_factors = tensors.get(ROPE_FREQS)
    if frequency_factors is not None:
        if scaling != "none":
            raise ConfigError(
                f"the file has both {scaling!r} rope scaling and a {ROPE_FREQS} tensor; astrai "
                "reads one or the other"
            )
        return {"rope_type": "frequency_factors", "factors": _vector(frequency_factors)}
    if scaling == "none":
        return None
    if scaling != "linear":
        raise ConfigError(
            f"unsupported GGUF rope scaling type {scaling!r}; astrai reads 'linear', a "
            f"{ROPE_FREQS} tensor (Llama 3.1's scaling), Phi-3's rope_factors_* tensors or none"
        )
    return {"rope_type": "linear", "factor": factor}


def _vector(tensor: Any) -> list[float]:
    """A one-dimensional tensor's numbers (rope factors)."""
    return [float(f) for f in decode_blocks(tensor.data, tensor.tensor_type)]
