"""The model's small ops -- RMSNorm with the residual add, SiLU-and-mul, rope -- one call each.

For fp32 and bf16 on the CPU they run on the _fused_ops kernels: at batch 1 the 35 or so
PyTorch ops between a layer's linears cost a third of a decode step in dispatch and allocation
alone (benchmarks/README.md). A bf16 kernel computes in fp32 and rounds wherever the PyTorch
formula rounds. Everything else (other dtypes and devices, gradients, torch.compile tracing,
an install without a C compiler) takes the PyTorch formulas, which are transformers' own op
for op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    from astrai.model import _fused_ops
except ImportError:  # installed without a C compiler: the PyTorch formulas below
    _fused_ops = None


KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _takes_cpu_kernel(x: Tensor, weight: Tensor | None = None) -> bool:
    """Whether x (and weight) may go to a C kernel: fp32 or bf16 on the CPU, no autograd, no
    tracing.

    Called for every op of every step, so it is cheap tests first and no loops.
    """
    return (
        x.dtype in KERNEL_DTYPES
        and x.is_cpu
        and (weight is None or (weight.dtype == x.dtype and weight.is_cpu))
        # The kernels have no backward: training and gradients stay on PyTorch ops.
        and not (
            torch.is_grad_enabled()
            and (x.requires_grad or (weight is not None and weight.requires_grad))
        )
        # torch.compile traces the PyTorch formulas and fuses them itself.
        and not torch.compiler.is_compiling()
    )


def _kernel_takes_rows(x: Tensor, weight: Tensor) -> bool:
    # The kernels read rows of dim contiguous floats, 8 at a time.
    return (
        _fused_ops is not None
        and x.shape[-1] % 8 == 0
        and x.is_contiguous()
        and weight.is_contiguous()
        and _takes_cpu_kernel(x, weight)
    )


def _rms_norm_kernel(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    out = torch.empty_like(x)
    total = None if residual is None else torch.empty_like(x)
    _fused_ops.rms_norm(
        out.data_ptr(),
        0 if total is None else total.data_ptr(),
        x.data_ptr(),
        0 if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        eps,
        x.numel() // x.shape[-1],
        x.shape[-1],
        x.dtype == torch.bfloat16,
    )
    return out, total


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim in fp32, cast back to x's dtype before the weight, as
    transformers computes it."""
    if _kernel_takes_rows(x, weight):
        return _rms_norm_kernel(x, weight, eps, None)[0]
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # One op instead of six, the same result bit for bit in fp32 (tested); in bf16 it would
        # round once where transformers rounds twice.
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual): a pre-norm layer's residual add and next norm."""
    if _kernel_takes_rows(x, weight) and residual.is_contiguous() and residual.shape == x.shape:
        return _rms_norm_kernel(x, weight, eps, residual)
    total = x + residual
    return rms_norm(total, weight, eps), total


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up, where gate_up [..., 2 * dim] holds gate then up (SwiGLU)."""
    dim = gate_up.shape[-1] // 2
    if (
        _fused_ops is not None
        and dim % 8 == 0
        and gate_up.is_contiguous()
        and _takes_cpu_kernel(gate_up)
    ):
        out = gate_up.new_empty(*gate_up.shape[:-1], dim)
        _fused_ops.silu_mul(
            out.data_ptr(), gate_up.data_ptr(), out.numel() // dim, dim, out.dtype == torch.bfloat16
        )
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate x [num_tokens, heads, head_dim] in transformers' rotate_half layout.

    The two halves of head_dim are the (real, imaginary) parts. cos is [num_tokens, 1, head_dim]
    (the half-width cos twice), signed_sin is (-sin, sin), both already cast to x's dtype as
    transformers does. x * cos + swap_halves(x) * signed_sin is transformers'
    x * cos + rotate_half(x) * sin term for term (adding -a is subtracting a, exactly), so the
    kernel and the four PyTorch ops both round exactly as transformers does.
    """
    num_tokens, heads, head_dim = x.shape
    if (
        _fused_ops is not None
        and x.stride(2) == 1
        and x.stride(1) == head_dim
        and cos.is_contiguous()
        and signed_sin.is_contiguous()
        and _takes_cpu_kernel(x, cos)
    ):
        out = x.new_empty(x.shape)
        _fused_ops.rope(
            out.data_ptr(), x.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), num_tokens,
            heads, head_dim, x.stride(0), x.dtype == torch.bfloat16,
        )  # fmt: skip
        return out
    return x * cos + x.roll(head_dim // 2, dims=-1) * signed_sin
