"""The model's small ops -- RMSNorm with the residual add, SiLU- or GELU-and-mul, rope -- one
call each.

For fp32 and bf16 on the CPU they run on C kernels, on a GPU on Triton kernels
(triton_ops.py): at batch 1 the 35 or so PyTorch ops between a layer's linears cost much of a
decode step in dispatch and allocation alone. A bf16 kernel computes in fp32 and rounds
wherever the PyTorch formula rounds. Everything else (other dtypes, gradients, an install
without a C compiler or Triton) takes the PyTorch formulas, which are transformers' own op
for op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.kernels import native, triton_ops
from astrai.kernels.graph import launch, new_output
from astrai.kernels.native import kernel_op


def _rows_kernel_takes(x: Tensor, weight: Tensor) -> bool:
    """The norm kernels' rule: contiguous rows of dim values read 8 at a time."""
    return (
        native.fused_ops is not None
        and x.shape[-1] % 8 == 0
        and x.is_contiguous()
        and weight.is_contiguous()
        and native.cpu_kernel_may_take(x, weight)
    )


def _rms_norm_into(
    out: Tensor,
    total: Tensor | None,
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor,
    eps: float,
) -> None:
    launch(
        native.fused_ops.rms_norm,
        out.data_ptr(), 0 if total is None else total.data_ptr(), x.data_ptr(),
        0 if residual is None else residual.data_ptr(), weight.data_ptr(), eps,
        x.numel() // x.shape[-1], x.shape[-1], x.dtype == torch.bfloat16,
    )  # fmt: skip


@kernel_op("rms_norm", fake=lambda x, weight, eps: torch.empty_like(x))
def _rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    out = new_output(x.shape, x.dtype)
    _rms_norm_into(out, None, x, None, weight, eps)
    return out


@kernel_op("add_rms_norm", fake=lambda x, *_: (torch.empty_like(x), torch.empty_like(x)))
def _add_rms_norm_op(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    out, total = new_output(x.shape, x.dtype), new_output(x.shape, x.dtype)
    _rms_norm_into(out, total, x, residual, weight, eps)
    return out, total


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim in fp32, cast back to x's dtype before the weight, as
    transformers computes it."""
    if _rows_kernel_takes(x, weight):
        return torch.ops.astrai.rms_norm(x, weight, eps)
    if triton_ops.takes(x, weight) and x.stride(-1) == 1:
        return triton_ops.rms_norm(x, weight, eps)[0]
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # One op instead of six, the same result bit for bit in fp32 (tested); in bf16 it would
        # round once where transformers rounds twice.
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual): a pre-norm layer's residual add and next norm."""
    if (
        _rows_kernel_takes(x, weight)
        and residual.is_contiguous()
        and residual.shape == x.shape
        and residual.dtype == x.dtype
    ):
        return torch.ops.astrai.add_rms_norm(x, residual, weight, eps)
    if (
        triton_ops.takes(x, residual, weight)
        and residual.shape == x.shape
        and x.stride(-1) == residual.stride(-1) == 1
    ):
        return triton_ops.rms_norm(x, weight, eps, residual)
    total = x + residual
    return rms_norm(total, weight, eps), total


def _gated_mul(gate_up: Tensor, gelu: bool) -> Tensor:
    dim = gate_up.shape[-1] // 2
    out = new_output((*gate_up.shape[:-1], dim), gate_up.dtype)
    launch(
        native.fused_ops.gated_mul,
        out.data_ptr(), gate_up.data_ptr(), out.numel() // dim, dim, gelu,
        out.dtype == torch.bfloat16,
    )  # fmt: skip
    return out


def _gated_fake(gate_up: Tensor) -> Tensor:
    return gate_up[..., : gate_up.shape[-1] // 2].clone()


@kernel_op("silu_and_mul", fake=_gated_fake)
def _silu_and_mul_op(gate_up: Tensor) -> Tensor:
    return _gated_mul(gate_up, gelu=False)


@kernel_op("gelu_tanh_and_mul", fake=_gated_fake)
def _gelu_tanh_and_mul_op(gate_up: Tensor) -> Tensor:
    return _gated_mul(gate_up, gelu=True)


def _gate_up_kernel_takes(gate_up: Tensor) -> bool:
    """The gated kernels' rule: contiguous rows of gate then up, dim values each, read 8 at a
    time."""
    return (
        native.fused_ops is not None
        and gate_up.shape[-1] // 2 % 8 == 0
        and gate_up.is_contiguous()
        and native.cpu_kernel_may_take(gate_up)
    )


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up, where gate_up [..., 2 * dim] holds gate then up (SwiGLU)."""
    if _gate_up_kernel_takes(gate_up):
        return torch.ops.astrai.silu_and_mul(gate_up)
    if triton_ops.takes(gate_up) and gate_up.stride(-1) == 1:
        return triton_ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: Tensor) -> Tensor:
    """gelu(gate) * up with GELU's tanh approximation, where gate_up [..., 2 * dim] holds gate
    then up (Gemma's GeGLU)."""
    if _gate_up_kernel_takes(gate_up):
        return torch.ops.astrai.gelu_tanh_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@kernel_op("rope", fake=lambda x, *_: torch.empty_like(x, memory_format=torch.contiguous_format))
def _rope_op(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    num_tokens, heads, head_dim = x.shape
    out = new_output(x.shape, x.dtype)
    launch(
        native.fused_ops.rope,
        out.data_ptr(), x.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), num_tokens, heads,
        head_dim, x.stride(0), x.dtype == torch.bfloat16,
    )  # fmt: skip
    return out


@kernel_op(
    "gather_rows", fake=lambda table, index: table.new_empty(index.shape[0], *table.shape[1:])
)
def _gather_rows_op(table: Tensor, index: Tensor) -> Tensor:
    out = new_output((index.shape[0], *table.shape[1:]), table.dtype)
    launch(
        native.fused_ops.gather_rows,
        out.data_ptr(), table.data_ptr(), index.data_ptr(), index.shape[0],
        table.stride(0) * table.element_size(), table.shape[0],
    )  # fmt: skip
    return out


def gather_rows(table: Tensor, index: Tensor) -> Tensor:
    """table's rows index [n] (int64), [n, ...]: table.index_select(0, index), on the CPU one
    C call that a recorded step replays (an index outside the table raises IndexError)."""
    if (
        native.fused_ops is not None
        and native.cpu_kernel_may_take(table)
        and table.is_contiguous()
        and index.dtype == torch.int64
        and index.dim() == 1
        and index.is_contiguous()
    ):
        return torch.ops.astrai.gather_rows(table, index)
    return table.index_select(0, index)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate x [num_tokens, heads, head_dim] in transformers' rotate_half layout.

    The two halves of head_dim are the (real, imaginary) parts. cos is [num_tokens, 1, head_dim]
    (the half-width cos twice), signed_sin is (-sin, sin), both already cast to x's dtype as
    transformers does. x * cos + swap_halves(x) * signed_sin is transformers'
    x * cos + rotate_half(x) * sin term for term (adding -a is subtracting a, exactly), so the
    kernel and the four PyTorch ops both round exactly as transformers does.
    """
    head_dim = x.shape[-1]
    if (
        native.fused_ops is not None
        and x.stride(2) == 1
        and x.stride(1) == head_dim
        and cos.is_contiguous()
        and signed_sin.is_contiguous()
        and native.cpu_kernel_may_take(x, cos, signed_sin)
    ):
        return torch.ops.astrai.rope(x, cos, signed_sin)
    if (
        triton_ops.takes(x, cos, signed_sin)
        and x.stride(2) == 1
        and cos.is_contiguous()
        and signed_sin.is_contiguous()
    ):
        return triton_ops.apply_rope(x, cos, signed_sin)
    return x * cos + x.roll(head_dim // 2, dims=-1) * signed_sin
