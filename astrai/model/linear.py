"""Linear layers whose few-row products on the CPU run on the _skinny_linear kernel.

A decode step multiplies a few rows (one per running sequence) by every weight of the model,
so it is bound by how fast the weights stream from memory. MKL, which F.linear calls, does
that badly at small M; the C kernel reads each weight once across all threads. Measured on a
2-core AMD EPYC over all 120 linears of a SmolLM2-135M-shaped model: 1 row 34 -> 17 ms,
8 rows 47 -> 28 ms, 32 rows 89 -> 62 ms, a tie at 64 and 128, MKL ahead at 256
(benchmarks/README.md). Bigger products (prefill) and other devices stay on F.linear.

bf16 takes the kernel too where PyTorch has no fast bf16 GEMM (no AVX-512 bf16 instructions
or AMX): there the kernel streams the bf16 weights and sums in fp32, and bigger bf16 products
run as fp32 GEMMs on upcast copies, which compute what a bf16 GEMM does (exact products,
fp32 sums, one rounding) at fp32's rate instead of a fifth of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

try:
    from astrai.model import _skinny_linear
except ImportError:  # installed without a C compiler: every product runs on F.linear
    _skinny_linear = None

SKINNY_MAX_ROWS = 64


def bf16_matmul_is_slow() -> bool:
    """Whether PyTorch's CPU bf16 GEMMs are emulated: fast ones need AVX-512 bf16 or AMX, and on
    an AVX2 CPU they ran at 15.8 GFLOP/s against fp32's 74.7 (64 rows)."""
    try:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):  # a build without oneDNN: leave bf16 to PyTorch
        return False


SLOW_BF16_MATMUL = bf16_matmul_is_slow()
KERNEL_DTYPES = (torch.float32, torch.bfloat16) if SLOW_BF16_MATMUL else (torch.float32,)


def runs_skinny(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether linear(x, weight, bias) takes the skinny kernel rather than F.linear.

    Called for every linear of every step, so the cheapest tests come first.
    """
    return (
        _skinny_linear is not None
        and x.dtype in KERNEL_DTYPES
        and weight.dtype == x.dtype
        and x.is_cpu
        and weight.is_cpu
        and x.numel() <= SKINNY_MAX_ROWS * weight.shape[1]
        # the kernel reads a row 8 floats or 16 bf16 at a time
        and weight.shape[1] % (8 if x.dtype == torch.float32 else 16) == 0
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
        # The kernel has no backward: training and gradients stay on F.linear.
        and not (
            torch.is_grad_enabled()
            and (
                x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
            )
        )
        # torch.compile traces F.linear and picks its own kernels.
        and not torch.compiler.is_compiling()
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias), on the skinny kernel or fp32 GEMMs where they are faster."""
    if not runs_skinny(x, weight, bias):
        if SLOW_BF16_MATMUL and x.dtype == weight.dtype == torch.bfloat16 and x.is_cpu:
            bias = None if bias is None else bias.float()
            return F.linear(x.float(), weight.float(), bias).to(torch.bfloat16)
        return F.linear(x, weight, bias)
    x = x.contiguous()
    out_features, in_features = weight.shape
    out = x.new_empty(*x.shape[:-1], out_features)
    _skinny_linear.linear(
        out.data_ptr(),
        x.data_ptr(),
        weight.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        x.numel() // in_features,
        in_features,
        out_features,
        x.dtype == torch.bfloat16,
    )
    return out


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose forward is linear()."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
