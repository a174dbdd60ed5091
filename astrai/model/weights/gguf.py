"""Load a Transformer from a GGUF file: the config from its metadata, the weights as blocks.

The file is read memory-mapped with the `gguf` package. On the CPU a linear whose block type
has a kernel keeps its blocks (a QuantizedLinear); every other tensor is dequantized once, to
the requested dtype, straight from the mapping. llama.cpp's converter stores the rows of a
Llama model's attn_q and attn_k permuted (each head's rotary halves interleaved); they are
put back in the order astrai's rotate-half RoPE expects, as rows of blocks or of numbers.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize as decode_blocks

from astrai.config import LAYER_TYPES, ConfigError, ModelConfig, MoEConfig
from astrai.kernels.quant_blocks import BLOCK_TYPES
from astrai.kernels.quant_ops import QuantizedLinear, QuantizedWeight, concat_columns
from astrai.model.automodel import (
    CheckpointError,
    WeightShard,
    _sources,
    expert_template,
    loading,
    part_rows,
)
from astrai.model.transformer import Transformer
from astrai.model.weights.quantize import is_linear_weight, replace_linear

log = logging.getLogger(__name__)
# Mixtral is a "llama" file with experts.
ARCHITECTURES = (
    "llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3", "olmo2", "granite", "gemma2",
    "gemma3",
)  # fmt: skip
# llama.cpp's converter permutes attn_q and attn_k rows for its llama-style rope on these.
PERMUTED_ARCHITECTURES = ("llama", "granite")
# The block types astrai dequantizes at load; the quantization issue keeps some as they are.
TENSOR_TYPES = tuple(
    GGMLQuantizationType[name]
    for name in (
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    )
)  # fmt: skip
QUANTIZED = frozenset(TENSOR_TYPES) - {GGMLQuantizationType[n] for n in ("F32", "F16", "BF16")}
# Hugging Face tensor name (below model.layers.N.) -> GGUF name (below blk.N.).
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"self_attn.{p}_proj.{w}": f"attn_{p}.{w}" for p in "qkv" for w in ("weight", "bias")},
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Experts as llama.cpp's first Mixtral files held them, one tensor each: _per_expert
    # splits the 3-D tensors of today's files (ffn_gate_exps, ...) into these.
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.{e}.gate_proj.weight": "ffn_gate.{e}.weight",
    "mlp.experts.{e}.up_proj.weight": "ffn_up.{e}.weight",
    "mlp.experts.{e}.down_proj.weight": "ffn_down.{e}.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    # Phi-3's fused projections
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
# With post-norms (OLMo 2, Gemma) HF's post_attention_layernorm norms the attention's output.
# llama.cpp's converter has added Gemma's 1 to its (1 + w) norm weights already.
GGUF_POST_NORM_LAYER_NAMES = {
    **GGUF_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# Llama 3.1's rope scaling as llama.cpp stores it: a divisor for each rotary frequency.
ROPE_FREQS = "rope_freqs.weight"
# Phi-3's LongRoPE divisors within and past the original context.
LONGROPE_FACTORS = {
    "short_factor": "rope_factors_short.weight",
    "long_factor": "rope_factors_long.weight",
}
GGUF_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def load_gguf(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    dequantize: bool = False,
    shard: WeightShard | None = None,
) -> Transformer:
    """The Transformer of a GGUF file. On the CPU a linear whose blocks have a kernel (Q8_0,
    Q4_0, Q4_1, Q5_0, Q4_K, Q6_K) keeps them, unless dequantize; every other tensor is dequantized
    to dtype on device. With shard, the rank's share of each tensor is read: rows of blocks,
    or columns cut at block boundaries (shard_problems says where they cannot be)."""
    reader = open_gguf(path)
    tensors = {name: part for tensor in reader.tensors for name, part in _per_expert(tensor)}
    config = gguf_model_config(reader)
    with torch.device("meta"):
        model = Transformer(config)
    # native name -> the GGUF tensors (name, torch-order shape) it concatenates
    arch = reader_architecture(reader)
    layout = {
        name: [
            (_gguf_name(hf, config.post_norms), shape)
            for hf, shape in _sources(config, name, t.shape, False, arch == "phi3")
        ]
        for name, t in model.state_dict().items()
    }
    _check(path, layout, tensors, config)
    if shard is not None:
        with torch.device("meta"):
            model = shard.model(config)
    permuted = arch in PERMUTED_ARCHITECTURES
    quantize = not dequantize and device.type == "cpu"
    state, dequantized = {}, set()
    for name, parts in loading(layout.items(), path):
        sources = [tensors[source] for source, _ in parts]
        linear = is_linear_weight(model, name) or name == "tok_embeddings.weight"
        in_blocks = quantize and linear and _has_kernel(sources)
        # a tensor's stored rows: of blocks' bytes if it stays in blocks, else of numbers
        rows = [t.data if in_blocks else decode_blocks(t.data, t.tensor_type) for t in sources]
        if shard is not None:
            sizes = [GGML_QUANT_SIZES[t.tensor_type] if in_blocks else (1, 1) for t in sources]
            rows = _shard_rows(rows, sizes, shard.spans(name, config), sources[0].name)
        if permuted:  # after sharding, which takes whole heads: only the share is read
            rows = [_unpermuted(t, r, config) for t, r in zip(sources, rows, strict=True)]
        if in_blocks and name != "tok_embeddings.weight":
            replace_linear(model, name, functools.partial(_quantized_linear, sources, rows))
        elif in_blocks:
            table = _quantized_linear(sources, rows)
            state[name] = table.weight.dequantize(dtype)  # rows are looked up, not streamed
            if config.tie_weight:  # the tied head streams the whole table: from its blocks
                model.output = table
        else:
            loaded = [_tensor(r, dtype) for r in rows]
            state[name] = (loaded[0] if len(loaded) == 1 else torch.cat(loaded)).to(device)
            if quantize:
                dequantized.update(
                    t.tensor_type.name for t in sources if t.tensor_type in QUANTIZED
                )
    if dequantized:
        log.info(
            "dequantized to %s at load, no kernel runs them: %s tensors (kernels: %s)",
            dtype, "/".join(sorted(dequantized)), "/".join(t.name for t in BLOCK_TYPES),
        )  # fmt: skip
    model.load_state_dict(state, strict=True, assign=True)
    # Moves the rope buffer (built on CPU in fp32) to the device, keeping it fp32.
    model.to(device)
    return model.requires_grad_(False).eval()


def _per_expert(tensor) -> list[tuple[str, object]]:
    """A file's tensor as (name, tensor) pairs named as GGUF_LAYER_NAMES reads them: a layer's
    experts in one 3-D tensor (ffn_gate_exps) as one 2-D view each (ffn_gate.{e}), the shared
    expert's gate, which llama.cpp stores as a vector, as the one-row matrix it is, any other
    tensor as it is."""
    experts = re.fullmatch(r"(blk\.\d+\.ffn_(?:gate|up|down))_exps\.weight", tensor.name)
    if experts is not None and len(tensor.shape) == 3:
        n_experts = int(tensor.shape[2])
        views = []
        for expert in range(n_experts):
            name = f"{experts[1]}.{expert}.weight"
            view = tensor._replace(
                name=name,
                shape=tensor.shape[:2],
                data=tensor.data[expert],
                n_elements=tensor.n_elements // n_experts,
                n_bytes=tensor.n_bytes // n_experts,
            )
            views.append((name, view))
        return views
    if tensor.name.endswith("ffn_gate_inp_shexp.weight") and len(tensor.shape) == 1:
        row = tensor._replace(shape=np.append(tensor.shape, 1), data=tensor.data.reshape(1, -1))
        return [(tensor.name, row)]
    return [(tensor.name, tensor)]


def _has_kernel(sources: list) -> bool:
    return all(tensor.tensor_type in BLOCK_TYPES for tensor in sources)


def _quantized_linear(
    sources: list, raws: list[np.ndarray], bias: torch.Tensor | None = None
) -> torch.nn.Module:
    """One QuantizedLinear over the sources' rows of blocks (raws), stacked; sources of
    different block types (a Q4_K_M file's Q4_K q and k beside a Q6_K v) stay apart, their
    outputs concatenated."""
    if len({tensor.tensor_type for tensor in sources}) > 1:
        parts = [_quantized_linear([t], [raw]) for t, raw in zip(sources, raws, strict=True)]
        return ConcatenatedLinear(parts, bias)
    blocks = raws[0] if len(raws) == 1 else np.concatenate(raws)
    block_weights, block_bytes = GGML_QUANT_SIZES[sources[0].tensor_type]
    shape = (blocks.shape[0], blocks.shape[1] // block_bytes * block_weights)
    return QuantizedLinear(QuantizedWeight.from_gguf(blocks, sources[0].tensor_type, shape), bias)


def _unpermuted(tensor, raw: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Stored rows raw of a tensor (one per output feature: of blocks' bytes, or of numbers),
    whole heads of them, with a q or k weight's rows put back in astrai's rope order."""
    if not tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
        return raw
    return unpermute_rotary_rows(raw, len(raw) // config.head_dim)


def _shard_rows(
    rows: list[np.ndarray],
    block_sizes: list[tuple[int, int]],
    spans: tuple[int, list[tuple[int, int]]] | None,
    name: str,
) -> list[np.ndarray]:
    """Each source's stored rows that a tensor-parallel rank holds, as WeightShard.spans says:
    ranges of the sources' rows one after another (dim 0), or of the one source's columns
    (dim 1), which start and stop at block boundaries. block_sizes: each source's (weights,
    stored units) per block, (1, 1) for rows of numbers."""
    if spans is None:
        return rows
    dim, ranges = spans
    if dim == 1:
        [(start, stop)], [stored], [(block, units)] = ranges, rows, block_sizes
        if start % block or stop % block:
            raise ConfigError(
                f"{name}: a rank's columns {start}..{stop} cut its blocks of {block} weights; "
                "load it with dequantize=True (--dequantize) or pick another tensor_parallel_size"
            )
        return [stored[:, start // block * units : stop // block * units]]
    slices = part_rows([len(stored) for stored in rows], ranges)
    return [
        np.concatenate([stored[share] for share in shares])
        for stored, shares in zip(rows, slices, strict=True)
    ]


def shard_problems(path: Path, size: int) -> list[str]:
    """Why a GGUF file's row-parallel linears (attn_output, the ffn_down of the MLP, of the
    experts and of the shared expert) cannot be split into size ranks' columns at their block
    boundaries; [] when they can."""
    problems = set()
    for tensor in open_gguf(path).tensors:
        if not re.search(r"\.(attn_output|ffn_down(_exps|_shexp)?)\.weight$", tensor.name):
            continue
        block = GGML_QUANT_SIZES[tensor.tensor_type][0]
        share = _shape(tensor)[-1] // size
        if share % block:
            problems.add(
                f"{tensor.name.split('.', 2)[2]} in {tensor.tensor_type.name} blocks of {block} "
                f"weights: a rank's {share} columns cut them"
            )
    return sorted(problems)


class ConcatenatedLinear(torch.nn.Module):
    """Linears over one input whose outputs are concatenated (plus a bias): a fused projection
    whose parts are quantized in different block types."""

    def __init__(self, parts: list[torch.nn.Module], bias: torch.Tensor | None):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return concat_columns([part(x) for part in self.parts], self.bias)


def open_gguf(path: Path) -> GGUFReader:
    """A memory-mapped reader of path, or a CheckpointError if it is not a whole GGUF file.

    The model loader and the tokenizer both read the file: the last readers are kept, keyed by
    the file's identity, so its metadata is parsed once.
    """
    stat = Path(path).stat()
    return _reader(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int, size: int) -> GGUFReader:
    try:
        return _PlainArrayReader(path)
    except (ValueError, OSError, KeyError, IndexError) as error:
        raise CheckpointError(
            f"cannot read GGUF file {path} ({str(error).rstrip('.')}): the file is truncated, "
            "corrupt or not GGUF; download it again"
        ) from error


class _PlainArrayReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its mapping. Slicing numpy's memmap subclass
    costs microseconds each, and the reader slices several times per vocabulary token: parsing
    a 49k-token vocabulary takes 1.5 s on a memmap, 0.5 s on the plain view."""

    @property
    def data(self) -> np.ndarray:
        return self._mapping

    @data.setter
    def data(self, mapping: np.memmap) -> None:
        self._mapping = mapping.view(np.ndarray)


def reader_architecture(reader: GGUFReader) -> str:
    """general.architecture of the file, refused unless astrai runs it."""
    architecture = _metadata(reader, "general.architecture", None)
    if architecture not in ARCHITECTURES:
        raise CheckpointError(
            f"unsupported GGUF architecture {architecture!r}; astrai loads {list(ARCHITECTURES)}"
        )
    return architecture


def gguf_model_config(reader: GGUFReader) -> ModelConfig:
    """The ModelConfig that a GGUF file's metadata (and its tensor list) describes."""
    arch = reader_architecture(reader)

    def key(name: str, default=...):
        return _metadata(reader, f"{arch}.{name}", default)

    dim = key("embedding_length")
    n_heads = key("attention.head_count")
    # Phi-3's rope may turn part of each head only: rope.dimension_count is no head size there.
    partial_rotary = arch == "phi3"
    head_dim = key("attention.key_length", None)
    head_dim = head_dim or (not partial_rotary and key("rope.dimension_count", None))
    head_dim = head_dim or dim // n_heads
    for other in ("attention.value_length", *(() if partial_rotary else ("rope.dimension_count",))):
        if key(other, head_dim) != head_dim:
            raise ConfigError(
                f"{arch}.{other} = {key(other)} differs from the head size {head_dim}: partial "
                "rotary embedding and value heads of another size are not supported"
            )
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    names = {tensor.name for tensor in reader.tensors}
    return ModelConfig(
        vocab_size=len(tokens.data) if tokens is not None else key("vocab_size"),
        dim=dim,
        n_layers=key("block_count"),
        n_heads=n_heads,
        n_kv_heads=key("attention.head_count_kv", None) or n_heads,
        head_dim=head_dim,
        dim_ffn=key("feed_forward_length"),
        norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=key("rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(reader, arch),
        max_len=key("context_length"),
        tie_weight="output.weight" not in names,
        use_qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
        attention_bias=arch in ("qwen2", "qwen2moe"),
        moe=_moe(key, arch, names),
        **_variant(key, arch),
        **(_gemma(key, arch, dim // n_heads, head_dim) if arch.startswith("gemma") else {}),
    )


def _variant(key, arch: str) -> dict:
    """What phi3, olmo2 and granite files change from the Llama decoder (key reads
    {arch}.name), as ModelConfig fields."""
    if arch == "phi3":
        window = key("attention.sliding_window", None)  # every layer slides, when shorter
        sliding = (
            {} if not window or window >= key("context_length") else {"sliding_window": window}
        )
        return {"rotary_dim": key("rope.dimension_count", None), **sliding}
    if arch == "olmo2":
        return {"pre_norms": False, "post_norms": True, "qk_norm_across_heads": True}
    if arch == "granite":
        return {
            "embedding_multiplier": key("embedding_scale", 1.0),
            "attention_scale": key("attention.scale", None),
            "residual_multiplier": key("residual_scale", 1.0),
            "logits_scaling": key("logit_scale", 1.0),
        }
    return {}


# llama.cpp's Gemma settings that its files do not hold: the 27B models (by their layer count)
# scale queries by dim / n_heads, the others by head_dim; Gemma 2 slides in every other layer,
# Gemma 3 in 5 of every 6, its sliding layers' rope base 10000.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def _gemma(key, arch: str, dim_per_head: int, head_dim: int) -> dict:
    """What gemma2 and gemma3 files change from the Llama decoder, as ModelConfig fields."""
    n_layers, window = key("block_count"), key("attention.sliding_window", None)
    pattern = GEMMA_SLIDING_PATTERN[arch]
    query_scale = dim_per_head if n_layers == GEMMA_27B_LAYERS[arch] else head_dim
    settings = {
        "hidden_act": "gelu_tanh",
        "scale_embeddings": True,
        "post_norms": True,
        "attention_scale": query_scale**-0.5,
        # Gemma 2's soft-caps, with llama.cpp's defaults; Gemma 3 has none
        "attn_logit_softcap": key("attn_logit_softcapping", 50.0) if arch == "gemma2" else None,
        "final_logit_softcap": key("final_logit_softcapping", 30.0) if arch == "gemma2" else None,
        "rope_local_theta": GEMMA3_LOCAL_ROPE_THETA if arch == "gemma3" else None,
    }
    settings["layer_types"] = [LAYER_TYPES[(i + 1) % pattern != 0] for i in range(n_layers)]
    if window and window < key("context_length"):
        settings["sliding_window"] = window
    return settings


def _moe(key, arch: str, names: set[str]) -> MoEConfig | None:
    """The experts a file's metadata describes (key reads {arch}.name), None if it has none.
    A layer is sparse if the file holds its router; the chosen experts' weights are
    renormalised where the file says so or, as llama.cpp does, on every architecture but
    qwen2moe."""
    n_experts = key("expert_count", 0)
    if not n_experts:
        return None
    dense = [i for i in range(key("block_count")) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    return MoEConfig(
        n_experts=n_experts,
        n_experts_per_token=key("expert_used_count"),
        dim_expert=key("expert_feed_forward_length", None) or key("feed_forward_length"),
        norm_topk_prob=key("expert_weights_norm", arch != "qwen2moe"),
        dim_shared_expert=key("expert_shared_feed_forward_length", None),
        dense_layers=dense,
    )


def _rope_scaling(reader: GGUFReader, arch: str) -> dict | None:
    scaling = _metadata(reader, f"{arch}.rope.scaling.type", "none")
    factor = _metadata(reader, f"{arch}.rope.scaling.factor", None)
    if factor is None:  # older converters wrote only this key, for linear scaling
        factor = _metadata(reader, f"{arch}.rope.scale_linear", None)
        scaling = "linear" if factor not in (None, 1.0) else scaling
    tensors = {
        t.name: t for t in reader.tensors if t.name in (ROPE_FREQS, *LONGROPE_FACTORS.values())
    }
    if LONGROPE_FACTORS["short_factor"] in tensors:  # Phi-3
        return {
            "rope_type": "longrope",
            **{key: _vector(tensors[name]) for key, name in LONGROPE_FACTORS.items()},
            "original_max_position_embeddings": _metadata(
                reader, f"{arch}.rope.scaling.original_context_length"
            ),
            "attention_factor": _metadata(reader, f"{arch}.rope.scaling.attn_factor", 1.0),
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


def _vector(tensor) -> list[float]:
    """A one-dimensional tensor's numbers (rope factors)."""
    return [float(f) for f in decode_blocks(tensor.data, tensor.tensor_type)]


def _metadata(reader: GGUFReader, name: str, default=...):
    """A scalar metadata value; floats as the decimal the converter wrote (1e-05, not float32's
    9.99999974e-06). Without a default, a missing key is a CheckpointError."""
    field = reader.fields.get(name)
    if field is None:
        if default is ...:
            raise CheckpointError(f"GGUF metadata lacks required key {name!r}")
        return default
    value = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    if field.types[0] in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        return float(str(value[0]))
    if field.types[0] == GGUFValueType.BOOL:
        return bool(value[0])
    return int(value[0])


def _gguf_name(hf_name: str, post_norms: bool) -> str:
    if hf_name in GGUF_TOP_NAMES:
        return GGUF_TOP_NAMES[hf_name]
    _, _, layer, suffix = hf_name.split(".", 3)  # model.layers.N.suffix
    suffix, expert = expert_template(suffix)
    names = GGUF_POST_NORM_LAYER_NAMES if post_norms else GGUF_LAYER_NAMES
    return f"blk.{layer}.{names[suffix].format(e=expert)}"


def _check(path: Path, layout, tensors: dict, config: ModelConfig) -> None:
    """Raise one CheckpointError naming every unsupported, missing, unexpected or mis-shaped
    tensor."""
    wanted = {source: shape for parts in layout.values() for source, shape in parts}
    allowed_extra = {ROPE_FREQS, *LONGROPE_FACTORS.values()}
    allowed_extra |= {"output.weight"} if config.tie_weight else set()
    problems = []
    unsupported = sorted(
        f"{name} ({tensor.tensor_type.name})"
        for name, tensor in tensors.items()
        if tensor.tensor_type not in TENSOR_TYPES
    )
    if unsupported:
        problems.append(
            f"unsupported tensor types: {unsupported}; astrai reads "
            f"{[t.name for t in TENSOR_TYPES]}"
        )
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        problems.append(f"missing tensors: {missing}")
    unexpected = sorted(set(tensors) - set(wanted) - allowed_extra)
    if unexpected:
        problems.append(f"unexpected tensors (not supported): {unexpected}")
    misshaped = [
        f"{source} has shape {_shape(tensors[source])}, expected {list(shape)}"
        for source, shape in wanted.items()
        if source in tensors and tuple(_shape(tensors[source])) != shape
    ]
    if misshaped:
        problems.append("mis-shaped tensors: " + "; ".join(misshaped))
    if problems:
        raise CheckpointError(f"cannot load GGUF file {path}: " + ". ".join(problems))


def _shape(tensor) -> list[int]:
    # GGUF lists dimensions innermost first (ggml's ne); torch's order is the reverse.
    return [int(n) for n in reversed(tensor.shape)]


def _tensor(rows: np.ndarray, dtype) -> torch.Tensor:
    """Rows of numbers (of the read-only mapping, or decoded) as a torch tensor of dtype."""
    if not rows.flags.writeable:
        rows = rows.copy()
    return torch.from_numpy(np.ascontiguousarray(rows)).to(dtype)


def unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's permute of a q or k weight [n_heads * head_dim, dim].

    The converter reshapes to (n_heads, 2, head_dim // 2, dim) and swaps axes 1 and 2, which
    interleaves each head's two rotary halves; this swaps them back.
    """
    rows = weight.shape[0]
    halves = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)
