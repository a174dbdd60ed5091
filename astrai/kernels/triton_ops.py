"""The model's small ops on the GPU as one Triton kernel each: RMSNorm with its residual add,
SiLU-and-mul, rope.

PyTorch runs each as several kernels (an RMSNorm in bf16 is about eight), and at batch 1 a
decode step is mostly such launches between the linears. Each kernel computes in fp32 and
rounds to the model's dtype wherever the PyTorch formula in fused_ops.py rounds, so its
results are that formula's (up to the order of the norm's sum). fused_ops.py dispatches here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from astrai.kernels.triton_attention import available, triton

if available:
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(
        out_ptr,
        total_ptr,
        x_ptr,
        residual_ptr,
        weight_ptr,
        stride_x,
        stride_residual,
        eps,
        DIM: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        ROUND: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < DIM
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + row * stride_residual + cols, mask=inside, other=0.0)
            x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
            tl.store(total_ptr + row * DIM + cols, x, mask=inside)
        x32 = x.to(tl.float32)
        normed = x32 * tl.rsqrt(tl.sum(x32 * x32, 0) / DIM + eps)
        if ROUND:  # transformers rounds the normed row before the weight
            normed = normed.to(x.dtype).to(tl.float32)
        weight = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * DIM + cols, (weight * normed).to(x.dtype), mask=inside)

    @triton.jit
    def _silu_and_mul_kernel(
        out_ptr, gate_up_ptr, stride_row, DIM: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < DIM
        gate = tl.load(gate_up_ptr + row * stride_row + cols, mask=inside, other=0.0)
        up = tl.load(gate_up_ptr + row * stride_row + DIM + cols, mask=inside, other=0.0)
        gate32 = gate.to(tl.float32)
        silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * DIM + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=inside)

    @triton.jit
    def _rope_kernel(
        out_ptr,
        x_ptr,
        cos_ptr,
        sin_ptr,
        stride_token,
        stride_head,
        HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        d = tl.arange(0, BLOCK)
        inside = d < HEAD_DIM
        row = x_ptr + token * stride_token + head * stride_head
        x = tl.load(row + d, mask=inside, other=0.0)
        swapped = tl.load(row + (d + HEAD_DIM // 2) % HEAD_DIM, mask=inside, other=0.0)
        cos = tl.load(cos_ptr + token * HEAD_DIM + d, mask=inside, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + token * HEAD_DIM + d, mask=inside, other=0.0).to(tl.float32)
        a = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
        b = (swapped.to(tl.float32) * sin).to(x.dtype).to(tl.float32)
        out = out_ptr + (token * HEADS + head) * HEAD_DIM + d
        tl.store(out, (a + b).to(x.dtype), mask=inside)


def takes(x: Tensor, *others: Tensor) -> bool:
    """The rule of every op here: Triton present, on the GPU, no gradient to track."""
    return (
        available
        and x.is_cuda
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *others)))
    )


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual) over the last dim; without residual, x itself is
    the second. Rows must have contiguous columns."""
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    total = x2 if residual is None else torch.empty_like(out)
    res2 = x2 if residual is None else residual.reshape(-1, dim)
    _rms_norm_kernel[(x2.shape[0],)](
        out, total, x2, res2, weight, x2.stride(0), res2.stride(0), eps, DIM=dim,
        BLOCK=triton.next_power_of_2(dim), HAS_RESIDUAL=residual is not None,
        ROUND=x.dtype != torch.float32,
    )  # fmt: skip
    return out.view(x.shape), total.view(x.shape)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of gate_up [..., 2 * dim] holding gate then up."""
    dim = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * dim)
    out = torch.empty((rows.shape[0], dim), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(dim))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(dim, block))](
        out, rows, rows.stride(0), DIM=dim, BLOCK=block
    )
    return out.view(*gate_up.shape[:-1], dim)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """fused_ops.apply_rope's x * cos + swap_halves(x) * signed_sin for x [tokens, heads,
    head_dim] with contiguous heads; cos and signed_sin [tokens, 1, head_dim], contiguous."""
    tokens, heads, head_dim = x.shape
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    _rope_kernel[(tokens, heads)](
        out, x, cos, signed_sin, x.stride(0), x.stride(1), HEADS=heads, HEAD_DIM=head_dim,
        BLOCK=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out
