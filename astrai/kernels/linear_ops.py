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
tune_linears() times the model's own weights when an engine is built, and the engine's
KernelPlan (kernel_plan.py) keeps the answer; each product looks its path up by rows in the
plan active on its thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.kernels import native, tuning_cache
from astrai.kernels.graph import launch, new_output
from astrai.kernels.kernel_plan import (
    DEFAULT_PREFETCH,
    ISA_TIMED_ROWS,
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


def choose_path(x: Tensor, weight: Tensor, bias: Tensor | None, choice: LinearChoice) -> LinearPath:
    """The path for this product: choice's for x's rows, where it runs (else the GEMM)."""
    path = choice.path(x.numel() // weight.shape[1])
    if path is LinearPath.KERNEL and not kernel_takes(x, weight, bias):
        path = LinearPath.GEMM
    if path is LinearPath.DOWNCAST or (path is LinearPath.UPCAST and x.dtype != torch.bfloat16):
        path = LinearPath.GEMM
    return path


def _upcast_linear(out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    bias = None if bias is None else bias.float()
    out.copy_(F.linear(x.float(), weight.float(), bias))


def _run(
    path: LinearPath,
    out: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    bf16_path: str,
    prefetch: int,
) -> None:
    """out [rows, out_features] = x [rows, in_features] W^T + b along path; the kernel's bf16
    products on bf16_path, prefetching W prefetch bytes ahead."""
    if path is LinearPath.KERNEL:
        launch(
            native.skinny_linear.linear,
            out.data_ptr(), x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
            x.shape[0], x.shape[1], weight.shape[0], x.dtype == torch.bfloat16, bf16_path,
            prefetch,
        )  # fmt: skip
    elif path is LinearPath.GEMM and bias is None:
        launch(torch.mm, x, weight.t(), out=out)
    elif path is LinearPath.GEMM:
        launch(torch.addmm, bias, x, weight.t(), out=out)
    else:
        launch(_upcast_linear, out, x, weight, bias)


@kernel_op(
    "linear",
    fake=lambda x, weight, bias, path, bf16_path, prefetch: x.new_empty(
        *x.shape[:-1], weight.shape[0]
    ),
)
def _linear_op(
    x: Tensor, weight: Tensor, bias: Tensor | None, path: str, bf16_path: str, prefetch: int
) -> Tensor:
    rows_shape = x.shape[:-1]
    x = x.view(-1, x.shape[-1])
    out = new_output((x.shape[0], weight.shape[0]), x.dtype)
    _run(LinearPath(path), out, x, weight, bias, bf16_path, prefetch)
    return out.view(*rows_shape, weight.shape[0])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias), for fp32 and bf16 on the CPU by the path the active
    KernelPlan chose for x's rows."""
    if native.cpu_kernel_may_take(x, weight, bias):
        # Copied out here, where a recording sees the copy (and refuses to replay it), not
        # inside the op, where a replay would read memory freed after the recording.
        x = x.contiguous()
        choice = active_plan().dense_choice(x.dtype)
        path = choose_path(x, weight, bias, choice)
        return torch.ops.astrai.linear(x, weight, bias, path, choice.isa, choice.prefetch)
    return F.linear(x, weight, bias)


def _time_path(
    path: LinearPath,
    weights: Sequence[Tensor],
    rows: int,
    limit: float,
    bf16_path: str = "vec8",
    prefetch: int = DEFAULT_PREFETCH,
) -> float:
    """Seconds for one pass of rows x every weight along path (the kernel's bf16 products on
    bf16_path, prefetching prefetch bytes ahead); inf once it passes limit."""

    def product(out: Tensor, x: Tensor, w: Tensor) -> None:
        _run(path, out, x, w, None, bf16_path, prefetch)

    return time_pass(weights, weights[0].dtype, rows, limit, product)


@torch.inference_mode()
def tune_linears(weights: Sequence[Tensor], forced: LinearPath | None = None) -> LinearChoice:
    """The choice for these weights (one model's dense linears, in order), timed once per
    machine (tuning_cache keeps the answer): for bf16 first the kernel's CPU path and prefetch
    distance, then the fastest path per row bucket. With a forced path, nothing is timed."""
    dtype = weights[0].dtype
    if dtype not in native.KERNEL_DTYPES or forced is not None:
        return untuned_choice(False, dtype, forced)
    shapes = tuple(tuple(w.shape) for w in weights)
    paths = tuning_cache.remembered("linear", dtype, shapes, lambda: _fastest_paths(weights))
    if _times_bf16_paths(dtype):
        bf16_path, distance, *paths = paths
        return LinearChoice(tuple(LinearPath(p) for p in paths), bf16_path, int(distance))
    return LinearChoice(tuple(LinearPath(p) for p in paths), "vec8")


def _times_bf16_paths(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and native.skinny_linear is not None


def _fastest_paths(weights: Sequence[Tensor]) -> list:
    """The fastest path at each row bucket, timed on these weights; for bf16 with the kernel
    built, first the kernel's fastest CPU path and prefetch distance (_fastest_bf16_kernel),
    which the kernel's timings then take."""
    dtype = weights[0].dtype
    streamed = streamed_weights(weights, lambda w: w.numel() * w.element_size())
    settings = _fastest_bf16_kernel(streamed) if _times_bf16_paths(dtype) else []
    bf16_path, distance = settings or ("vec8", DEFAULT_PREFETCH)
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
        timings = {
            p: partial(_time_path, p, timed, bucket, bf16_path=bf16_path, prefetch=distance)
            for p in candidates
        }
        paths.append(fastest(timings, LinearPath.KERNEL))
    return [*settings, *paths]


def _fastest_bf16_kernel(weights: Sequence[Tensor]) -> list:
    """[the kernel's fastest bf16 CPU path, its fastest prefetch distance], each timed on a
    pass of ISA_TIMED_ROWS over the weights it takes. vec8, the path every x86 CPU runs, is
    kept unless another is KERNEL_PREFERENCE faster; the distance is timed only for the
    AVX-512 paths, which prefetch."""
    taken = [w for w in weights if kernel_takes(w[:1], w, None)]
    if not taken:
        return ["vec8", DEFAULT_PREFETCH]

    def kernel_pass(bf16_path: str, distance: int, rows: int, limit: float) -> float:
        return _time_path(LinearPath.KERNEL, taken, rows, limit, bf16_path, distance)

    path = fastest_isa(native.skinny_linear.bf16_paths(), "vec8", kernel_pass)
    if path == "vec8":
        return [path, DEFAULT_PREFETCH]
    return [path, fastest_prefetch(path, kernel_pass, ISA_TIMED_ROWS)]
