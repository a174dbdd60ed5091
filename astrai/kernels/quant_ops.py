"""y = x W^T + b for W kept in GGUF's quantized blocks (Q8_0, Q4_0, Q4_1), on the CPU.

A batch-1 decode step is bound by reading the weights, so a 4-bit W reads a quarter of what a
bf16 one does. Paths, as for the dense linears (linear_ops.LinearPath):

- kernel: the C kernel (csrc/quant_linear.c) on the packed blocks: x quantized per 32-block to
  int8, integer multiply-adds (AVX512-VNNI, AVX2 or portable scalar code);
- gemm: W dequantized to x's dtype, then PyTorch's GEMM: for prefill-sized products, which are
  bound by arithmetic, not bytes;
- upcast: W dequantized to fp32 for an fp32 GEMM, for bf16 x where bf16 GEMMs are emulated.

tune_quant_linears() times them on the model's own weights once per process (and the kernel's
CPU paths, among those the CPU runs); ASTRAI_LINEAR_PATH forces one, as for dense linears.
Without the C extension, W is dequantized once by the gguf package and F.linear runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K
from torch import Tensor, nn

from astrai.kernels import native
from astrai.kernels.graph import launch, new_output
from astrai.kernels.linear_ops import (
    KERNEL_PREFERENCE,
    ROW_BUCKETS,
    SKINNY_MAX_ROWS,
    STREAMED_BYTES,
    LinearPath,
    forced_path,
)

# Rows of W in one packed record (csrc/quant_linear.c describes the layout).
GROUP = 4
BLOCK = 32
Q = GGMLQuantizationType


@dataclass(frozen=True)
class BlockType:
    """One GGUF block type as the kernel packs it: 32-blocks per unit (a K type's super-block),
    and the scale fields a unit keeps per row: (name, dtype, count), in record order."""

    qtype: GGMLQuantizationType
    unit_blocks: int
    fields: tuple[tuple[str, type, int], ...]

    @property
    def unit_weights(self) -> int:
        return BLOCK * self.unit_blocks


BLOCK_TYPES = {
    t.qtype: t
    for t in (
        BlockType(Q.Q8_0, 1, (("d", np.float16, 1),)),
        BlockType(Q.Q4_0, 1, (("d", np.float16, 1),)),
        BlockType(Q.Q4_1, 1, (("d", np.float16, 1), ("m", np.float16, 1))),
        BlockType(
            Q.Q4_K,
            8,
            (
                ("sc", np.uint8, 8),
                ("mn", np.uint8, 8),
                ("d", np.float16, 1),
                ("dmin", np.float16, 1),
            ),
        ),
        BlockType(Q.Q6_K, 8, (("sc", np.int8, 16), ("d", np.float16, 1))),
    )
}


def _gguf_fields(blocks: np.ndarray, qtype, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """W's GGUF blocks decoded: codes "u" uint8 [rows, in / 32, 32] (Q8_0: its int8 bytes),
    and each scale field [rows, units, count], as the gguf package reads them."""
    kind = BLOCK_TYPES[qtype]
    rows, units = shape[0], shape[1] // kind.unit_weights
    b = np.asarray(blocks, np.uint8).reshape(rows * units, -1)

    def halves(at: int) -> np.ndarray:
        return b[:, at : at + 2].copy().view(np.float16).reshape(rows, units, 1)

    def nibbles(qs: np.ndarray) -> np.ndarray:  # GGUF's 16 bytes per 32 weights: k, k + 16
        return np.concatenate([qs & 15, qs >> 4], axis=-1)

    if qtype == Q.Q8_0:
        fields = {"u": b[:, 2:], "d": halves(0)}
    elif qtype in (Q.Q4_0, Q.Q4_1):
        fields = {"u": nibbles(b[:, -16:]), "d": halves(0)}
        if qtype == Q.Q4_1:
            fields["m"] = halves(2)
    elif qtype == Q.Q4_K:  # 64 weights per 32 bytes of qs: low nibbles first, then high
        sc, mn = Q4_K.get_scale_min(b[:, 4:16])
        u = nibbles(b[:, 16:].reshape(-1, 4, 32))
        fields = {"u": u, "sc": sc, "mn": mn, "d": halves(0), "dmin": halves(2)}
    else:  # Q6_K: 128 weights per 64 bytes of ql (4 low bits) and 32 of qh (2 high bits)
        ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
            1, 1, 4, 1
        )
        u = (ql & 15).reshape(-1, 8, 32) | (qh & 3).reshape(-1, 8, 32) << 4
        fields = {"u": u, "sc": b[:, 192:208].view(np.int8), "d": halves(208)}
    return {
        name: field.reshape(rows, -1, 32) if name == "u" else field.reshape(rows, units, -1)
        for name, field in fields.items()
    }


def _dense(fields: dict[str, np.ndarray], qtype) -> np.ndarray:
    """W [rows, in] in fp32 from its fields, in the gguf package's fp32 operations."""
    u, rows = fields["u"], fields["u"].shape[0]

    def per(scale: np.ndarray, weights: int) -> np.ndarray:  # a scale for every weight
        return np.repeat(scale.astype(np.float32).reshape(rows, -1), weights, axis=1)

    if qtype == Q.Q8_0:
        return per(fields["d"], 32) * u.view(np.int8).reshape(rows, -1).astype(np.float32)
    codes = u.reshape(rows, -1).astype(np.float32)
    if qtype == Q.Q4_0:
        return per(fields["d"], 32) * (codes - 8)
    if qtype == Q.Q4_1:
        return per(fields["d"], 32) * codes + per(fields["m"], 32)
    if qtype == Q.Q4_K:
        d = fields["d"].astype(np.float32) * fields["sc"]
        dmin = fields["dmin"].astype(np.float32) * fields["mn"]
        return per(d, 32) * codes - per(dmin, 32)
    return per(fields["d"].astype(np.float32) * fields["sc"], 16) * (codes - 32)


def _to_records(x: np.ndarray) -> np.ndarray:
    """[rows, units, ...] -> [groups, units, GROUP, ...], rows padded to whole groups."""
    rows = x.shape[0]
    padded = np.zeros((-(-rows // GROUP) * GROUP, *x.shape[1:]), x.dtype)
    padded[:rows] = x
    padded = padded.reshape(-1, GROUP, *x.shape[1:])
    return np.moveaxis(padded, 1, 2)


def pack_blocks(blocks: np.ndarray, qtype, shape: tuple[int, int]) -> np.ndarray:
    """GGUF blocks of W [out_features, in_features] (any uint8 array holding them in order) as
    the kernel's records: uint8 [groups, units, record bytes]."""
    kind = BLOCK_TYPES[qtype]
    fields = _gguf_fields(blocks, qtype, shape)
    rows, units = shape[0], shape[1] // kind.unit_weights
    u = fields["u"].reshape(rows, units, kind.unit_blocks, 32)
    if qtype == Q.Q8_0:  # [groups, units, 2 halves, GROUP, 16]
        parts = [np.moveaxis(_to_records(u.reshape(rows, units, 2, 16)), 2, 3)]
    else:  # [groups, units, blocks, GROUP, 16]: element k low, k + 16 high
        codes = (u[..., :16] & 15) | (u[..., 16:] & 15) << 4
        parts = [np.moveaxis(_to_records(codes), 2, 3)]
    if qtype == Q.Q6_K:  # bits 2 f.. of part p: block 2 p + f // 2, element k + 16 (f % 2)
        high = (u >> 4).reshape(rows, units, 4, 4, 16)  # [.., part, f, k]
        bits = sum(high[:, :, :, f] << (2 * f) for f in range(4)).astype(np.uint8)
        parts.append(np.moveaxis(_to_records(bits), 2, 3))
    for name, dtype, _ in kind.fields:  # [groups, units, count, GROUP]
        field = np.moveaxis(_to_records(fields[name].astype(dtype)), 2, 3)
        parts.append(np.ascontiguousarray(field).view(np.uint8))
    groups = parts[0].shape[0]
    return np.concatenate([p.reshape(groups, units, -1) for p in parts], axis=-1)


def _packed_fields(packed: np.ndarray, qtype, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """pack_blocks undone: the fields _gguf_fields gives."""
    kind = BLOCK_TYPES[qtype]
    groups, units, _ = packed.shape
    rows, at = shape[0], 0

    def take(nbytes: int, dtype=np.uint8, inner: tuple = ()) -> np.ndarray:
        """The next nbytes of each record as [rows, units, *inner] from [*inner', GROUP]."""
        nonlocal at
        part = packed[..., at : at + nbytes].copy().view(dtype)
        at += nbytes
        part = part.reshape(groups, units, *inner)
        return part

    fields = {}
    if qtype == Q.Q8_0:
        u = np.moveaxis(take(128, inner=(2, GROUP, 16)), 3, 1).reshape(-1, units, 32)
    else:
        codes = np.moveaxis(take(64 * kind.unit_blocks, inner=(kind.unit_blocks, GROUP, 16)), 3, 1)
        u = np.concatenate([codes & 15, codes >> 4], axis=-1).reshape(
            -1, units, kind.unit_blocks, 32
        )
        if qtype == Q.Q6_K:
            bits = np.moveaxis(take(256, inner=(4, GROUP, 16)), 3, 1).reshape(-1, units, 4, 1, 16)
            high = bits >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1) & 3
            u = u | (high.reshape(-1, units, 8, 32) << 4)
    fields["u"] = u.reshape(groups * GROUP, -1, 32)[:rows]
    for name, dtype, count in kind.fields:
        nbytes = count * GROUP * np.dtype(dtype).itemsize
        fields[name] = np.moveaxis(take(nbytes, dtype, (count, GROUP)), 3, 1).reshape(
            groups * GROUP, units, count
        )[:rows]
    return fields


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
            fields = _packed_fields(self.packed.numpy(), self.qtype, self.shape)
            self._kept[dtype] = torch.from_numpy(_dense(fields, self.qtype)).to(dtype)
        return self._kept[dtype]


# x dtype -> the path of each row bucket, set by tune_quant_linears()
_paths: dict[torch.dtype, list[LinearPath]] = {}
_timed: dict[tuple, list[LinearPath]] = {}


def _untuned(dtype: torch.dtype) -> list[LinearPath]:
    large = LinearPath.UPCAST if dtype == torch.bfloat16 else LinearPath.GEMM
    return [LinearPath.KERNEL if b <= SKINNY_MAX_ROWS else large for b in ROW_BUCKETS]


def choose_path(x: Tensor) -> LinearPath:
    """The path for x [rows, in_features]: forced, else tuned (or the untuned default)."""
    path = forced_path()
    if path is None:
        rows = x.shape[0]
        paths = _paths.get(x.dtype) or _untuned(x.dtype)
        path = next((p for b, p in zip(ROW_BUCKETS, paths, strict=True) if rows <= b), paths[-1])
    if path is LinearPath.UPCAST and x.dtype != torch.bfloat16:
        path = LinearPath.GEMM
    return path


def _dequantize(packed: Tensor, qtype: int, shape: tuple[int, int], dtype) -> Tensor:
    """W [out_features, in_features] in dtype (fp32 or bf16) from its packed blocks, in C."""
    out = torch.empty(shape, dtype=dtype)
    native.quant_linear.dequantize(
        out.data_ptr(), packed.data_ptr(), *shape, qtype, dtype == torch.bfloat16
    )
    return out


def _dense_linear(
    out: Tensor, x: Tensor, packed: Tensor, qtype: int, bias: Tensor | None, dtype: torch.dtype
) -> None:
    """out = x W^T + b by PyTorch's GEMM in dtype on W dequantized to it, rounded into out."""
    weight = _dequantize(packed, qtype, (out.shape[1], x.shape[1]), dtype)
    out.copy_(F.linear(x.to(dtype), weight, None if bias is None else bias.to(dtype)))


def _run(path, out: Tensor, x: Tensor, packed: Tensor, qtype: int, bias: Tensor | None) -> None:
    """out [rows, out_features] = x [rows, in_features] W^T + b along path."""
    if path is LinearPath.KERNEL:
        launch(
            native.quant_linear.linear,
            out.data_ptr(), x.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
            x.shape[0], x.shape[1], out.shape[1], qtype, x.dtype == torch.bfloat16,
        )  # fmt: skip
    else:
        dtype = torch.float32 if path is LinearPath.UPCAST else x.dtype
        launch(_dense_linear, out, x, packed, qtype, bias, dtype)


@torch.library.custom_op("astrai::quant_linear", mutates_args=())
def _quant_linear_op(
    x: Tensor, packed: Tensor, qtype: int, out_features: int, bias: Tensor | None
) -> Tensor:
    rows_shape = x.shape[:-1]
    x = x.view(-1, x.shape[-1])
    out = new_output((x.shape[0], out_features), x.dtype)
    _run(choose_path(x), out, x, packed, qtype, bias)
    return out.view(*rows_shape, out_features)


_quant_linear_op.register_fake(
    lambda x, packed, qtype, out_features, bias: x.new_empty(*x.shape[:-1], out_features)
)


def quant_linear(x: Tensor, weight: QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, W, bias) for a quantized W, by the measured fastest path on the CPU."""
    if native.quant_linear is not None and native.cpu_kernel_may_take(x, bias):
        return torch.ops.astrai.quant_linear(
            x.contiguous(), weight.packed, int(weight.qtype), weight.shape[0], bias
        )
    return F.linear(x, weight.dequantize(x.dtype), bias)


class QuantizedLinear(nn.Module):
    """A linear layer whose W stays quantized: what a model builds for a quantized tensor."""

    def __init__(self, weight: QuantizedWeight, bias: Tensor | None = None):
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return quant_linear(x, self.weight, self.bias)


def _time_path(
    path: LinearPath, weights: Sequence[QuantizedWeight], dtype, rows: int, limit: float
) -> float:
    """Seconds for one pass of rows x every weight along path; inf once it passes limit."""
    generator = torch.Generator().manual_seed(0)  # leaves the caller's random state alone
    inputs = {
        w.shape[1]: torch.randn(rows, w.shape[1], generator=generator).to(dtype) for w in weights
    }
    outs = [torch.empty(rows, w.shape[0], dtype=dtype) for w in weights]
    start = time.perf_counter()
    for w, out in zip(weights, outs, strict=True):
        _run(path, out, inputs[w.shape[1]], w.packed, w.qtype, None)
        if time.perf_counter() - start > limit:
            return float("inf")
    return time.perf_counter() - start


def _fastest(timings: dict, runs: int = 2) -> object:
    """The key of the fastest of timings' callables (each limit -> seconds), run alternately
    so that one slow moment does not decide; the first key wins ties within KERNEL_PREFERENCE."""
    best = dict.fromkeys(timings, float("inf"))
    for _ in range(runs):
        for key, timing in timings.items():
            best[key] = min(best[key], timing(min(best.values()) * KERNEL_PREFERENCE))
    first = next(iter(best))
    best[first] /= KERNEL_PREFERENCE
    return min(best, key=best.get)


@torch.inference_mode()
def tune_quant_linears(
    weights: Sequence[QuantizedWeight], dtype: torch.dtype
) -> dict[int, LinearPath]:
    """Time the paths for x of dtype on these weights (one model's quantized linears, in
    order; once per process) -- first the kernel's CPU paths at one row, keeping the fastest
    -- use the fastest path per row bucket from now on, and return them {bucket: path}."""
    key = (dtype, tuple((w.qtype, w.shape) for w in weights))
    if native.quant_linear is not None and key not in _timed and forced_path() is None:
        streamed, size = [], 0
        for w in weights:  # as many as a step reads, up to past the largest L3s
            if size >= STREAMED_BYTES:
                break
            streamed.append(w)
            size += w.nbytes()
        isas = reversed(native.quant_linear.isas())  # the widest first: it wins ties

        def kernel_on(isa: str, limit: float) -> float:
            native.quant_linear.set_isa(isa)
            return _time_path(LinearPath.KERNEL, streamed, dtype, 1, limit)

        native.quant_linear.set_isa(_fastest({isa: partial(kernel_on, isa) for isa in isas}))
        paths = []
        for bucket in ROW_BUCKETS:
            # few rows stream the weights; many are bound by arithmetic: a layer's weights
            timed = streamed if bucket <= SKINNY_MAX_ROWS else weights[:4]
            candidates = [LinearPath.KERNEL, LinearPath.GEMM]
            if dtype == torch.bfloat16:
                candidates.append(LinearPath.UPCAST)
            paths.append(
                _fastest({p: partial(_time_path, p, timed, dtype, bucket) for p in candidates})
            )
        _timed[key] = paths
    if key in _timed:
        _paths[dtype] = _timed[key]
    return dict(zip(ROW_BUCKETS, _paths.get(dtype) or _untuned(dtype), strict=True))
