"""y = x W^T + b on the CPU, by whichever of three paths this machine runs fastest.

- kernel: the skinny C kernel, for up to SKINNY_MAX_ROWS rows. A decode step multiplies a few
  rows by every weight, so it is bound by streaming the weights, which BLAS does badly at
  small M; the kernel reads each weight once across all threads, and bf16 weights as bf16. Its
  bf16 products have CPU paths of their own (vec8; AVX-512 FMAs on widened W; vdpbf16ps) and
  a prefetch distance, timed first.
- gemm: PyTorch's GEMM in the tensors' own dtype (oneDNN/MKL).
- upcast: for bf16, an fp32 GEMM on fp32 copies, which computes what a bf16 GEMM does (exact
  products, fp32 sums, one rounding) at fp32's rate where bf16 GEMMs are emulated.
- downcast: for fp32 x on quantized weights only (quant_ops), a bf16 GEMM on bf16 copies. A
  dense fp32 W takes the GEMM instead: its products stay exact.

Which wins depends on the machine, the dtype and the rows -- an AMX Xeon's bf16 GEMM is fast for
a prefill and slow for a one-row decode, an AVX2 EPYC has no fast bf16 GEMM at all -- so
tune_linears() times the model's own weights once per process and dtype, and a lookup by rows
follows. ASTRAI_LINEAR_PATH=kernel|gemm|upcast|downcast forces one path wherever it can run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from enum import StrEnum
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astrai.kernels import native, tuning_cache
from astrai.kernels.graph import launch, new_output
from astrai.kernels.native import kernel_op

SKINNY_MAX_ROWS = 64
# Rows at which paths are timed; a product of r rows takes the path timed at the first bucket
# >= r. Two beyond the kernel's limit stand for prefill-sized products, a short prompt's and a
# long one's chunk (up to max_num_batched_tokens), as a path's cost per call (a quantized W's
# decoding for a GEMM) weighs differently at each.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, SKINNY_MAX_ROWS, 256, 1024)
# Rows of x a kernel's CPU paths are timed at: a decode step's one, and a speculative check's
# few, where the paths part (at one row they all wait on memory, and any can win by noise).
ISA_TIMED_ROWS = (1, 4)
# How far ahead in W's stream a kernel's prefetch is timed at, in bytes, with the chosen CPU
# path: the best distance depends on the machine's memory and prefetchers.
PREFETCH_DISTANCES = (1024, 2048, 4096)
DEFAULT_PREFETCH = 2048


class LinearPath(StrEnum):
    KERNEL = "kernel"
    GEMM = "gemm"
    UPCAST = "upcast"
    DOWNCAST = "downcast"


def _untuned(dtype: torch.dtype) -> list[LinearPath]:
    """Before any timing: the kernel for few rows, and for bf16 the upcast GEMM, which is
    never far behind a native bf16 GEMM and far ahead of an emulated one."""
    large = LinearPath.UPCAST if dtype == torch.bfloat16 else LinearPath.GEMM
    return [LinearPath.KERNEL] * (len(ROW_BUCKETS) - 1) + [large]


# dtype -> the path of each row bucket in use, set by tune_linears()
_paths: dict[torch.dtype, list[LinearPath]] = {}
# (dtype, weight shapes) -> the paths their timing chose, so each model is timed once a process
_timed: dict[tuple, list[LinearPath]] = {}


def forced_path() -> LinearPath | None:
    value = os.environ.get("ASTRAI_LINEAR_PATH")
    if not value:
        return None
    try:
        return LinearPath(value)
    except ValueError:
        choices = ", ".join(p.value for p in LinearPath)
        raise ValueError(f"ASTRAI_LINEAR_PATH={value!r}: use one of {choices}") from None


def kernel_takes(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """The skinny kernel's rule: few rows, rows read 8 floats or 16 bf16 at a time, W and the
    bias contiguous (x is made contiguous)."""
    return (
        native.skinny_linear is not None
        and x.numel() <= SKINNY_MAX_ROWS * weight.shape[1]
        and weight.shape[1] % (8 if x.dtype == torch.float32 else 16) == 0
        and weight.is_contiguous()
        and (bias is None or bias.is_contiguous())
    )


def choose_path(x: Tensor, weight: Tensor, bias: Tensor | None) -> LinearPath:
    """The path for this product: forced, else tuned (or the untuned default), where it runs."""
    rows = x.numel() // weight.shape[1]
    path = forced_path()
    if path is None:
        paths = _paths.get(x.dtype) or _untuned(x.dtype)
        path = next((p for b, p in zip(ROW_BUCKETS, paths, strict=True) if rows <= b), paths[-1])
    if path is LinearPath.KERNEL and not kernel_takes(x, weight, bias):
        path = LinearPath.GEMM
    if path is LinearPath.DOWNCAST or (path is LinearPath.UPCAST and x.dtype != torch.bfloat16):
        path = LinearPath.GEMM
    return path


def _upcast_linear(out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    bias = None if bias is None else bias.float()
    out.copy_(F.linear(x.float(), weight.float(), bias))


def _run(path: LinearPath, out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """out [rows, out_features] = x [rows, in_features] W^T + b along path."""
    if path is LinearPath.KERNEL:
        launch(
            native.skinny_linear.linear,
            out.data_ptr(), x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
            x.shape[0], x.shape[1], weight.shape[0], x.dtype == torch.bfloat16,
        )  # fmt: skip
    elif path is LinearPath.GEMM and bias is None:
        launch(torch.mm, x, weight.t(), out=out)
    elif path is LinearPath.GEMM:
        launch(torch.addmm, bias, x, weight.t(), out=out)
    else:
        launch(_upcast_linear, out, x, weight, bias)


@kernel_op("linear", fake=lambda x, weight, bias: x.new_empty(*x.shape[:-1], weight.shape[0]))
def _linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    rows_shape = x.shape[:-1]
    x = x.view(-1, x.shape[-1])
    out = new_output((x.shape[0], weight.shape[0]), x.dtype)
    _run(choose_path(x, weight, bias), out, x, weight, bias)
    return out.view(*rows_shape, weight.shape[0])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias), by the measured fastest path for fp32 and bf16 on the CPU."""
    if native.cpu_kernel_may_take(x, weight, bias):
        # Copied out here, where a recording sees the copy (and refuses to replay it), not
        # inside the op, where a replay would read memory freed after the recording.
        return torch.ops.astrai.linear(x.contiguous(), weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose forward is linear()."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def _time_path(path: LinearPath, weights: Sequence[Tensor], rows: int, limit: float) -> float:
    """Seconds for one pass of rows x every weight along path; inf once it passes limit."""
    generator = torch.Generator().manual_seed(0)  # leaves the caller's random state alone
    inputs = {
        w.shape[1]: torch.randn(rows, w.shape[1], generator=generator).to(w.dtype) for w in weights
    }
    outs = [torch.empty(rows, w.shape[0], dtype=w.dtype) for w in weights]
    start = time.perf_counter()
    for w, out in zip(weights, outs, strict=True):
        _run(path, out, inputs[w.shape[1]], w, None)
        if time.perf_counter() - start > limit:
            return float("inf")
    return time.perf_counter() - start


# The most weight bytes a few-row timing pass reads: beyond the largest L3s (480 MB seen).
STREAMED_BYTES = 1 << 30
# The kernel's rows do not depend on the batch; another path must beat it by this much.
KERNEL_PREFERENCE = 1.1


@torch.inference_mode()
def tune_linears(weights: Sequence[Tensor]) -> dict[int, LinearPath]:
    """Time the paths on these weights (one model's linears, in order; once per machine, as
    tuning_cache keeps the answer) -- for bf16 first the kernel's CPU path and prefetch
    distance -- use the fastest per row bucket for their dtype from now on, and return them
    {bucket: path}."""
    dtype = weights[0].dtype
    key = (dtype, tuple(tuple(w.shape) for w in weights))
    if dtype in native.KERNEL_DTYPES and key not in _timed and forced_path() is None:
        paths = tuning_cache.remembered("linear", dtype, key[1], lambda: _fastest_paths(weights))
        if _times_bf16_paths(dtype):
            bf16_path, distance, *paths = paths
            native.skinny_linear.set_bf16_path(bf16_path)
            native.skinny_linear.set_prefetch(int(distance))
        _timed[key] = [LinearPath(path) for path in paths]
    if key in _timed:
        _paths[dtype] = _timed[key]
    return dict(zip(ROW_BUCKETS, _paths.get(dtype) or _untuned(dtype), strict=True))


def _times_bf16_paths(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and native.skinny_linear is not None


def _fastest_paths(weights: Sequence[Tensor]) -> list:
    """The fastest path at each row bucket, timed on these weights; for bf16 with the kernel
    built, first the kernel's fastest CPU path and prefetch distance (_fastest_bf16_kernel)."""
    dtype = weights[0].dtype
    streamed = streamed_weights(weights, lambda w: w.numel() * w.element_size())
    settings = _fastest_bf16_kernel(streamed) if _times_bf16_paths(dtype) else []
    paths = []
    for bucket in ROW_BUCKETS:
        sample = torch.empty(bucket, weights[0].shape[1], dtype=dtype)
        if all(kernel_takes(sample, w, None) for w in weights):
            # A few-row product streams the weights, so it is timed on as many as a step
            # reads, up to more than a large L3 holds (a subset in the cache would flatter
            # the GEMM), and no more, so a big model's start stays short.
            candidates, timed = [LinearPath.KERNEL, LinearPath.GEMM], streamed
        else:
            # A prefill-sized product is compute-bound: a layer's weights time it.
            candidates, timed = [LinearPath.GEMM], weights[:4]
            if dtype == torch.bfloat16:
                candidates.append(LinearPath.UPCAST)
        timings = {p: partial(_time_path, p, timed, bucket) for p in candidates}
        paths.append(fastest(timings, LinearPath.KERNEL))
    return [*settings, *paths]


def _fastest_bf16_kernel(weights: Sequence[Tensor]) -> list:
    """[the kernel's fastest bf16 CPU path, its fastest prefetch distance], each timed on a
    pass of ISA_TIMED_ROWS over the weights it takes, and set. vec8, the path every x86 CPU
    runs, is kept unless another is KERNEL_PREFERENCE faster; the distance is timed only for
    the AVX-512 paths, which prefetch."""
    kernel = native.skinny_linear
    taken = [w for w in weights if kernel_takes(w[:1], w, None)]

    def kernel_on(path: str, distance: int, limit: float) -> float:
        kernel.set_bf16_path(path)
        kernel.set_prefetch(distance)
        seconds = 0.0
        for rows in ISA_TIMED_ROWS:
            seconds += _time_path(LinearPath.KERNEL, taken, rows, limit - seconds)
        return seconds

    path, distance = "vec8", DEFAULT_PREFETCH
    if taken:
        timings = {p: partial(kernel_on, p, DEFAULT_PREFETCH) for p in kernel.bf16_paths()}
        path = fastest(timings, "vec8")
    if taken and path != "vec8":
        distance = fastest({d: partial(kernel_on, path, d) for d in PREFETCH_DISTANCES}, distance)
    kernel.set_bf16_path(path)
    kernel.set_prefetch(distance)
    return [path, distance]


def streamed_weights(weights: Sequence, nbytes) -> list:
    """The first weights, as many as a step reads, until nbytes(w) sum past STREAMED_BYTES."""
    streamed, size = [], 0
    for w in weights:
        if size >= STREAMED_BYTES:
            break
        streamed.append(w)
        size += nbytes(w)
    return streamed


def fastest(timings: dict, preferred: object, runs: int = 2) -> object:
    """The key of the fastest of timings' callables (each limit -> seconds), run alternately
    so that one slow moment does not decide; preferred wins ties within KERNEL_PREFERENCE. A
    lone candidate is not timed."""
    if len(timings) == 1:
        return next(iter(timings))
    best = dict.fromkeys(timings, float("inf"))
    for _ in range(runs):
        for key, timing in timings.items():
            best[key] = min(best[key], timing(min(best.values()) * KERNEL_PREFERENCE))
    if preferred in best:
        best[preferred] /= KERNEL_PREFERENCE
    return min(best, key=best.get)
