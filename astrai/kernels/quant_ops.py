"""y = x W^T + b for W kept in GGUF's quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K) on
the CPU.

A batch-1 decode step is bound by reading the weights, so a 4-bit W reads a quarter of what a
bf16 one does. Paths, as for the dense linears (linear_ops.LinearPath):

- kernel: the C kernel (csrc/quant_linear.c) on the packed blocks: x quantized per 32-block to
  int8, integer multiply-adds (AVX512-VNNI, AVX2 or portable scalar code, by CPU). Its
  activation precision is a setting of the linear: int8x2 (the default) quantizes x in two
  terms, its int8 blocks and what they leave at 1/256 of their scale, together x in 16 bits,
  for twice the integer multiply-adds; int8 is one term, llama.cpp's rounding, which tips
  near-ties of a small model's greedy choice away from the reference's (benchmarks/README.md,
  "Activation precision");
- gemm: W dequantized to x's dtype, then PyTorch's GEMM: for prefill-sized products, which are
  bound by arithmetic, not bytes;
- upcast: W dequantized to fp32 for an fp32 GEMM, for bf16 x where bf16 GEMMs are emulated;
- downcast: for fp32 x, W dequantized to bf16 and x rounded to it for a bf16 GEMM (fp32 sums),
  where a matrix unit (AMX) runs those several times as fast as fp32 ones. It rounds x to 8
  significant bits, as the kernel's int8 blocks do (coarser, there), and W's decoded values.

tune_quant_linears() times them on the model's own weights when an engine is built (and the
kernel's CPU paths, among those the CPU runs), and the engine's KernelPlan keeps the answer,
as for dense linears (kernel_plan.py). The kernel's result for a row of x does not depend on
the batch, a GEMM path's roundings differ from it, so an engine takes the GEMM paths only when
built with batch_invariant=False.
Without the C extension, W is dequantized once (NumPy, as the gguf package does) for F.linear.

A quantized W is a QuantizedWeight (QuantizedWeight.from_gguf on the GGUF tensor's bytes), or a
ConcatenatedWeight where a fused projection's parts are in different block types; a Linear
(layers.py) holding one calls quant_linear(x, weight, bias) or concatenated_linear, which take
their activation precision from the active plan too. An embedding table in blocks is looked up
by lookup_rows, which decodes only the rows asked for.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import Tensor

from astrai.kernels import native, tuning_cache
from astrai.kernels.graph import launch, new_output
from astrai.kernels.kernel_plan import (
    ACTIVATION_TERMS,
    DEFAULT_ACTIVATION_PRECISION,
    DEFAULT_PREFETCH,
    ROW_BUCKETS,
    SKINNY_MAX_ROWS,
    LinearChoice,
    LinearPath,
    active_plan,
    fastest,
    fastest_isa,
    fastest_prefetch,
    streamed_weights,
    time_pass,
    untuned_choice,
)
from astrai.kernels.native import kernel_op
from astrai.kernels.quant_blocks import BLOCK_TYPES, dense_weight, pack_blocks, packed_fields


@dataclass
class QuantizedWeight:
    """A linear's W [out_features, in_features] in GGUF blocks, packed for the kernel."""

    packed: Tensor  # uint8 [groups, units, record bytes]
    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    # dtype -> W dequantized, kept only where no kernel is built (the slow fallback)
    _kept: dict[torch.dtype, Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def from_gguf(cls, blocks: np.ndarray, qtype: int, shape: tuple[int, int]):
        """From a GGUF tensor's raw bytes (GGUFReader's tensor.data); shape is
        (out_features, in_features), the reverse of the GGUF tensor's shape."""
        qtype = GGMLQuantizationType(qtype)
        if qtype not in BLOCK_TYPES:
            names = ", ".join(t.name for t in BLOCK_TYPES)
            raise ValueError(f"{qtype.name} weights have no quantized kernel (only {names})")
        unit = BLOCK_TYPES[qtype].unit_weights
        if shape[1] % unit:
            raise ValueError(f"{qtype.name}: in_features {shape[1]} is not a multiple of {unit}")
        shape = (int(shape[0]), int(shape[1]))
        return cls(torch.from_numpy(pack_blocks(blocks, qtype, shape)), qtype, shape)

    def nbytes(self) -> int:
        return self.packed.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """W as a dense [out_features, in_features] tensor: the C kernel's exact decoding where
        it is built, else NumPy's (and then kept, as the fallback reuses it)."""
        if native.quant_linear is not None and dtype in native.KERNEL_DTYPES:
            return _dequantize(self.packed, self.qtype, self.shape, dtype)
        if dtype not in self._kept:
            fields = packed_fields(self.packed.numpy(), self.qtype, self.shape)
            self._kept[dtype] = torch.from_numpy(dense_weight(fields, self.qtype)).to(dtype)
        return self._kept[dtype]


def choose_path(x: Tensor, choice: LinearChoice) -> LinearPath:
    """The path for x [rows, in_features]: choice's for its rows, where it runs."""
    path = choice.path(x.shape[0])
    if path is LinearPath.UPCAST and x.dtype != torch.bfloat16:
        path = LinearPath.GEMM
    if path is LinearPath.DOWNCAST and x.dtype != torch.float32:
        path = LinearPath.GEMM
    return path


def _dequantize(
    packed: Tensor,
    qtype: int,
    shape: tuple[int, int],
    dtype,
    out: Tensor | None = None,
    transposed: bool = False,
) -> Tensor:
    """W [out_features, in_features] in dtype (fp32 or bf16) from its packed blocks, in C, into
    out or a new tensor; or W^T [in_features, out_features] (transposed: AVX-512 path only)."""
    if out is None:
        out = torch.empty(shape[::-1] if transposed else shape, dtype=dtype)
    native.quant_linear.dequantize(
        out.data_ptr(), packed.data_ptr(), packed.nbytes, *shape, qtype, dtype == torch.bfloat16,
        transposed,
    )  # fmt: skip
    return out


_scratches = threading.local()


def _scratch(shape: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """A tensor of shape for W dequantized, in memory this thread reuses (as large as its
    largest W so far): a fresh allocation that size is mapped anew each time, and faulting its
    pages in took longer than decoding the blocks."""
    size = shape[0] * shape[1] * dtype.itemsize
    buffer = getattr(_scratches, "buffer", None)
    if buffer is None or buffer.numel() < size:
        buffer = _scratches.buffer = torch.empty(size, dtype=torch.uint8)
    return buffer[:size].view(dtype).view(shape)


def _dense_linear(
    out: Tensor,
    x: Tensor,
    packed: Tensor,
    qtype: int,
    bias: Tensor | None,
    dtype: torch.dtype,
    transposed: bool,
) -> None:
    """out = x W^T + b by PyTorch's GEMM in dtype on W dequantized to it; b is added in the
    wider of dtype and out's, then rounded into out once. transposed (on the AVX-512 path
    only) writes W^T, a column's 16 rows with one store, several times as fast as W's rows one
    at a time."""
    shape = (out.shape[1], x.shape[1])
    scratch = _scratch(shape[::-1] if transposed else shape, dtype)
    weight = _dequantize(packed, qtype, shape, dtype, scratch, transposed)
    product = torch.mm(x.to(dtype), weight if transposed else weight.t())
    if bias is None:
        out.copy_(product)
    else:
        torch.add(product, bias.to(torch.promote_types(dtype, out.dtype)), out=out)


# the GEMM paths that compute in a dtype other than x's
_GEMM_DTYPES = {LinearPath.UPCAST: torch.float32, LinearPath.DOWNCAST: torch.bfloat16}


def _run(
    path: LinearPath,
    out: Tensor,
    x: Tensor,
    packed: Tensor,
    qtype: int,
    bias: Tensor | None,
    terms: int,
    isa: str,
    prefetch: int,
) -> None:
    """out [rows, out_features] = x [rows, in_features] W^T + b along path; the kernel
    quantizes x in terms (ACTIVATION_TERMS) on its CPU path isa, prefetching W prefetch bytes
    ahead, and a GEMM path on the AVX-512 ISA dequantizes W transposed."""
    if path is LinearPath.KERNEL:
        launch(
            native.quant_linear.linear,
            out.data_ptr(), x.data_ptr(), packed.data_ptr(), packed.nbytes,
            0 if bias is None else bias.data_ptr(), x.shape[0], x.shape[1], out.shape[1], qtype,
            x.dtype == torch.bfloat16, terms, isa, prefetch,
        )  # fmt: skip
    else:
        dtype = _GEMM_DTYPES.get(path, x.dtype)
        launch(_dense_linear, out, x, packed, qtype, bias, dtype, isa == "avx512vnni")


@kernel_op(
    "quant_linear",
    fake=lambda x, packed, qtype, out_features, bias, path, terms, isa, prefetch: x.new_empty(
        *x.shape[:-1], out_features
    ),
)
def _quant_linear_op(
    x: Tensor,
    packed: Tensor,
    qtype: int,
    out_features: int,
    bias: Tensor | None,
    path: str,
    terms: int,
    isa: str,
    prefetch: int,
) -> Tensor:
    rows_shape = x.shape[:-1]
    x = x.view(-1, x.shape[-1])
    out = new_output((x.shape[0], out_features), x.dtype)
    _run(LinearPath(path), out, x, packed, qtype, bias, terms, isa, prefetch)
    return out.view(*rows_shape, out_features)


def quant_linear(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, W, bias) for a quantized W, on the CPU by the path the active KernelPlan
    chose for x's rows, the kernel quantizing x at the plan's activation precision."""
    if native.quant_linear is not None and native.cpu_kernel_may_take(x, bias):
        x = x.contiguous()
        plan = active_plan()
        choice = plan.quantized_choice(x.dtype)
        return torch.ops.astrai.quant_linear(
            x,
            weight.packed,
            int(weight.qtype),
            weight.shape[0],
            bias,
            choose_path(x.view(-1, x.shape[-1]), choice),
            plan.activation_terms,
            choice.isa,
            choice.prefetch,
        )
    return F.linear(x, weight.dequantize(x.dtype), bias)


@kernel_op(
    "quant_embedding",
    fake=lambda ids, packed, qtype, rows, dim, dtype: packed.new_empty(
        *ids.shape, dim, dtype=dtype
    ),
)
def _quant_embedding_op(
    ids: Tensor, packed: Tensor, qtype: int, rows: int, dim: int, dtype: torch.dtype
) -> Tensor:
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = new_output((flat.numel(), dim), dtype)
    launch(
        native.quant_linear.gather_rows,
        out.data_ptr(), packed.data_ptr(), packed.nbytes, flat.data_ptr(), flat.numel(), rows,
        dim, qtype, dtype == torch.bfloat16,
    )  # fmt: skip
    return out.view(*ids.shape, dim)


def lookup_rows(ids: Tensor, table: QuantizedWeight, dtype: torch.dtype) -> Tensor:
    """The rows ids [...] of an embedding table kept in its GGUF blocks, [..., dim] in dtype:
    decoded as they are looked up, exactly as QuantizedWeight.dequantize decodes them, so the
    table never sits in memory as dtype (113 MB of fp32 for SmolLM2's, 2.1 GB for Llama 3
    8B's)."""
    if native.quant_linear is None or dtype not in native.KERNEL_DTYPES:
        return F.embedding(ids, table.dequantize(dtype))
    # int64 ids before the op, so a recorded step reads the step's own (a conversion inside
    # the op would leave the recording a pointer to a temporary)
    return torch.ops.astrai.quant_embedding(
        ids.to(torch.int64).contiguous(), table.packed, int(table.qtype), *table.shape, dtype
    )


def _concat_into(out: Tensor, parts: list[Tensor], bias: Tensor | None) -> None:
    torch.cat(parts, dim=-1, out=out)
    if bias is not None:
        out.add_(bias)


@kernel_op("concat_columns", fake=lambda parts, bias: torch.cat(parts, dim=-1))
def _concat_columns_op(parts: list[Tensor], bias: Tensor | None) -> Tensor:
    out = new_output((*parts[0].shape[:-1], sum(p.shape[-1] for p in parts)), parts[0].dtype)
    launch(_concat_into, out, parts, bias)
    return out


def concat_columns(parts: list[Tensor], bias: Tensor | None = None) -> Tensor:
    """torch.cat(parts, dim=-1) + bias as one op a recorded step replays: the outputs of a
    projection split by block type (a Q4_K_M file's Q6_K v beside its Q4_K q and k) are joined
    without voiding the recording, which any other op would."""
    return torch.ops.astrai.concat_columns(parts, bias)


@dataclass(frozen=True)
class ConcatenatedWeight:
    """A fused projection's W whose parts (rows of W, one after another) are in different block
    types, as a Q4_K_M file's Q6_K v beside its Q4_K q and k: each part is multiplied alone and
    the outputs' columns joined."""

    parts: tuple[QuantizedWeight, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.shape[0] for part in self.parts), self.parts[0].shape[1]

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """W as a dense [out_features, in_features] tensor, its parts' rows stacked."""
        return torch.cat([part.dequantize(dtype) for part in self.parts])


def concatenated_linear(
    x: Tensor, weight: ConcatenatedWeight, bias: Tensor | None = None
) -> Tensor:
    """F.linear(x, W, bias) for W in parts: quant_linear by each, the columns joined (and
    biased) by one op a recorded step replays."""
    return concat_columns([quant_linear(x, part) for part in weight.parts], bias)


def _time_path(
    path: LinearPath,
    weights: Sequence[QuantizedWeight],
    dtype: torch.dtype,
    terms: int,
    rows: int,
    limit: float,
    isa: str,
    prefetch: int = DEFAULT_PREFETCH,
) -> float:
    """Seconds for one pass of rows x every weight along path (the kernel on isa, prefetching
    prefetch bytes ahead); inf once it passes limit."""

    def product(out: Tensor, x: Tensor, w: QuantizedWeight) -> None:
        _run(path, out, x, w.packed, w.qtype, None, terms, isa, prefetch)

    return time_pass(weights, dtype, rows, limit, product)


@torch.inference_mode()
def tune_quant_linears(
    weights: Sequence[QuantizedWeight],
    dtype: torch.dtype,
    batch_invariant: bool = True,
    activation_precision: str = DEFAULT_ACTIVATION_PRECISION,
    forced: LinearPath | None = None,
) -> LinearChoice:
    """The choice for x of dtype on these weights (one model's quantized linears, in order),
    timed once per machine (tuning_cache keeps the answer): first the kernel's CPU paths at
    ISA_TIMED_ROWS, keeping the fastest, then its prefetch distance, then the fastest path per
    row bucket (the kernel at every bucket if batch_invariant). With a forced path, nothing is
    timed.

    batch_invariant keeps the kernel at every bucket: its result for a row of x does not
    depend on the other rows, while a GEMM path's roundings differ from it (x in bf16 or
    fp32, not int8 blocks), so a prompt prefilled in a batch past the kernel's buckets would
    continue otherwise than the same prompt alone. The kernel is timed quantizing x at
    activation_precision, as it will run."""
    if native.quant_linear is None or forced is not None:
        return untuned_choice(True, dtype, forced)
    terms = ACTIVATION_TERMS[activation_precision]
    shapes = (terms, tuple((w.qtype, w.shape) for w in weights))
    isa, distance, *paths = tuning_cache.remembered(
        "quant_linear", dtype, shapes, lambda: _fastest_isa_and_paths(weights, dtype, terms)
    )
    if batch_invariant:
        return LinearChoice.everywhere(LinearPath.KERNEL, isa, int(distance))
    return LinearChoice(tuple(LinearPath(p) for p in paths), isa, int(distance))


def _fastest_isa_and_paths(
    weights: Sequence[QuantizedWeight], dtype: torch.dtype, terms: int
) -> list:
    """[the kernel's fastest CPU path (over a pass of each of ISA_TIMED_ROWS, prefetching
    DEFAULT_PREFETCH ahead), its fastest prefetch distance (a pass at one row), then the
    fastest path of each row bucket], timed.

    The kernel quantizes x and a GEMM does not, so their results differ by more than rounding:
    the kernel keeps every bucket up to the first a GEMM wins, and none beyond, so that a
    sequence's decode steps change path at one batch size, not back and forth."""
    streamed = streamed_weights(weights, QuantizedWeight.nbytes)
    isas = native.quant_linear.isas()[::-1]  # the widest first: it wins ties

    def kernel_pass(isa: str, distance: int, rows: int, limit: float) -> float:
        return _time_path(LinearPath.KERNEL, streamed, dtype, terms, rows, limit, isa, distance)

    isa = fastest_isa(isas, isas[0], kernel_pass)
    distance = fastest_prefetch(isa, kernel_pass, (1,))
    paths = []
    for bucket in ROW_BUCKETS:
        # few rows stream the weights; many are bound by arithmetic: a layer's weights
        timed = streamed if bucket <= SKINNY_MAX_ROWS else weights[:4]
        # the kernel first, so that a slower GEMM's pass is cut short at the kernel's time
        candidates = [LinearPath.KERNEL] if all(p is LinearPath.KERNEL for p in paths) else []
        candidates.append(LinearPath.GEMM)
        candidates.append(LinearPath.UPCAST if dtype == torch.bfloat16 else LinearPath.DOWNCAST)
        timings = {
            p: partial(_time_path, p, timed, dtype, terms, bucket, isa=isa, prefetch=distance)
            for p in candidates
        }
        paths.append(fastest(timings, LinearPath.KERNEL))
    return [isa, distance, *paths]
