"""Load a Transformer from a GGUF file: the config from its metadata, the weights as blocks.

The file is read memory-mapped: its header by gguf_reader, as the `gguf` package reads it, its
blocks decoded by the `gguf` package. On the CPU a linear whose block type has a kernel keeps
its blocks (the Linear built for it holds them), and so does the embedding table (its lookups
decode a step's rows; a tied head streams the same blocks); every other tensor is
dequantized once, to the requested dtype, straight from the mapping. The blocks are repacked
into memory of their own, so nothing refers to the mapping once the model is built: the reader
is shared only while someone holds it, and then closed with its map.

llama.cpp's converter stores the rows of a Llama model's attn_q and attn_k permuted (each
head's rotary halves interleaved); they are put back in the order astrai's rotate-half RoPE
expects, as rows of blocks or of numbers.
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading
import weakref
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as decode_blocks

from astrai.config import ConfigError, ModelConfig
from astrai.kernels.quant_blocks import BLOCK_TYPES
from astrai.kernels.quant_ops import ConcatenatedWeight, QuantizedWeight
from astrai.model.checkpoint import CheckpointError, WeightShard, loading, part_rows
from astrai.model.families import config_from_gguf, gguf_architecture, gguf_family
from astrai.model.families.gguf_config import LONGROPE_FACTORS, ROPE_FREQS
from astrai.model.transformer import Transformer
from astrai.model.weights.gguf_layout import check_gguf_layout
from astrai.model.weights.gguf_reader import GGUFFileReader
from astrai.model.weights.quantize import is_linear_weight

log = logging.getLogger(__name__)
# The block types astrai dequantizes at load; the quantization issue keeps some as they are.
TENSOR_TYPES = tuple(
    GGMLQuantizationType[name]
    for name in (
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    )
)  # fmt: skip
QUANTIZED = frozenset(TENSOR_TYPES) - {GGMLQuantizationType[n] for n in ("F32", "F16", "BF16")}


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
    config = config_from_gguf(reader, path)
    family = gguf_family(gguf_architecture(reader))
    # The tensors are views of the mapping; the reader (and its hold on the mapping) goes now.
    del reader
    with torch.device("meta"):
        model = Transformer(config)
    # native name -> the GGUF tensors (name, torch-order shape) it concatenates
    layout = {
        name: family.gguf_tensors(config, name, tuple(t.shape))
        for name, t in model.state_dict().items()
    }
    _check(path, layout, tensors, config)
    if shard is not None:
        with torch.device("meta"):
            model = shard.model(config)
    permuted = family.permuted_rotary_rows
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
            model.get_submodule(name.removesuffix(".weight")).hold(_blocks(sources, rows))
        elif in_blocks:  # the embedding table (a rank's: its share of the vocabulary's rows),
            # its rows decoded as a step looks them up
            table = _blocks(sources, rows)
            model.tok_embeddings.hold(table, dtype)
            if config.tie_weight:  # the tied head streams the whole table: the same blocks
                model.output.hold(table)
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
    _release_freed_memory()
    return model.requires_grad_(False).eval()


def _release_freed_memory() -> None:
    """Hand the pages of the load's freed arrays back to the system. Decoding and packing the
    blocks frees hundreds of temporaries between the blocks that stay; glibc keeps the pages
    of those it placed in its heap (20 MB of SmolLM2's 98 MB file) until asked to trim."""
    malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
    if malloc_trim is not None:
        malloc_trim(0)


def _per_expert(tensor) -> list[tuple[str, object]]:
    """A file's tensor as (name, tensor) pairs named as the family records read them: a layer's
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


def _blocks(sources: list, raws: list[np.ndarray]) -> QuantizedWeight | ConcatenatedWeight:
    """One QuantizedWeight of the sources' rows of blocks (raws), stacked; sources of
    different block types (a Q4_K_M file's Q4_K q and k beside a Q6_K v) stay apart, the
    parts of a ConcatenatedWeight."""
    if len({tensor.tensor_type for tensor in sources}) > 1:
        parts = (_blocks([t], [raw]) for t, raw in zip(sources, raws, strict=True))
        return ConcatenatedWeight(tuple(parts))
    blocks = raws[0] if len(raws) == 1 else np.concatenate(raws)
    block_weights, block_bytes = GGML_QUANT_SIZES[sources[0].tensor_type]
    shape = (blocks.shape[0], blocks.shape[1] // block_bytes * block_weights)
    return QuantizedWeight.from_gguf(blocks, sources[0].tensor_type, shape)


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


def open_gguf(path: Path) -> GGUFFileReader:
    """A memory-mapped reader of path, or a CheckpointError if it is not a whole GGUF file or
    its layout lies (gguf_layout says how).

    Readers of the file that overlap (the model loader's and the tokenizer's, or a rank's
    config and weights) share one, so its metadata is parsed once; none is kept beyond its
    last holder, as its mapping and parsed arrays are memory the process would keep for
    nothing.
    """
    stat = Path(path).stat()
    key = (str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)
    with _readers_lock:
        reader = _readers.get(key)
        if reader is None:
            reader = _readers[key] = _reader(key[0])
        return reader


_readers: weakref.WeakValueDictionary[tuple, GGUFFileReader] = weakref.WeakValueDictionary()
_readers_lock = threading.Lock()


def _reader(path: str) -> GGUFFileReader:
    try:
        check_gguf_layout(path)
        return GGUFFileReader(path)
    except CheckpointError:
        raise
    except (ValueError, OSError, KeyError, IndexError) as error:
        raise CheckpointError(
            f"cannot read GGUF file {path} ({str(error).rstrip('.')}): the file is truncated, "
            "corrupt or not GGUF; download it again"
        ) from error


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
