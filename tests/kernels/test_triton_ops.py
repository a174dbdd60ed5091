"""The GPU's small-op kernels (triton_ops) against the PyTorch formulas they replace: on a GPU
where there is one, else on CPU tensors under Triton's interpreter (which computes bf16
wrongly, so bf16 is checked on a GPU only)."""

from __future__ import annotations

import pytest
import torch

from astrai.kernels import fused_ops, native, triton_ops

pytestmark = pytest.mark.skipif(not triton_ops.available, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# The norm's sum is ordered otherwise than PyTorch's: its last bit may differ before rounding.
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.fixture
def formulas(monkeypatch):
    """fused_ops as an install with neither C kernels nor Triton runs it: the formulas."""
    monkeypatch.setattr(native, "fused_ops", None)
    monkeypatch.setattr(triton_ops, "available", False)


def close(actual, expected, dtype):
    torch.testing.assert_close(
        actual.cpu(), expected.cpu(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [576, 100, 2048])
def test_rms_norm_with_and_without_residual(dtype, dim, formulas):
    generator = torch.Generator().manual_seed(dim)
    x, residual = (torch.randn(5, dim, generator=generator).to(DEVICE, dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(dim, generator=generator)).to(DEVICE, dtype)
    close(triton_ops.rms_norm(x, weight, 1e-5)[0], fused_ops.rms_norm(x, weight, 1e-5), dtype)
    out, total = triton_ops.rms_norm(x, weight, 1e-5, residual)
    expected, expected_total = fused_ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, expected_total)  # one rounding of an exact fp32 sum
    close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [1536, 100])
def test_silu_and_mul(dtype, dim, formulas):
    gate_up = torch.randn(3, 2 * dim, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    close(triton_ops.silu_and_mul(gate_up), fused_ops.silu_and_mul(gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 96])
def test_rope_of_heads_lying_apart(dtype, head_dim, formulas):
    """q/k heads as the model hands them: a view into the fused qkv rows."""
    generator = torch.Generator().manual_seed(head_dim)
    tokens, heads = 4, 6
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=generator).to(DEVICE, dtype)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=generator) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(DEVICE, dtype)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1).to(DEVICE, dtype)
    out, expected = (
        triton_ops.apply_rope(x, cos, signed_sin),
        fused_ops.apply_rope(x, cos, signed_sin),
    )
    if DEVICE == "cpu":  # interpreted: no sum and no exp, the same roundings give the same bits
        assert torch.equal(out, expected)
    else:  # compiled, a product may meet the add in one fused multiply-add: the last bit moves
        ulp = torch.finfo(dtype).eps * expected.abs().clamp(min=1.0)
        assert bool(((out - expected).abs() <= ulp).all())


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_the_small_ops_of_a_gpu_tensor_go_to_the_kernels(monkeypatch):
    calls = []
    for name in ("rms_norm", "silu_and_mul", "apply_rope"):
        kernel = getattr(triton_ops, name)
        monkeypatch.setattr(
            triton_ops, name, lambda *a, kernel=kernel, name=name: calls.append(name) or kernel(*a)
        )
    x = torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)
    fused_ops.rms_norm(x, x[0], 1e-5)
    fused_ops.add_rms_norm(x, x, x[0], 1e-5)
    fused_ops.silu_and_mul(x)
    cos = torch.ones(2, 1, 16, device="cuda", dtype=torch.bfloat16)
    fused_ops.apply_rope(x.view(2, 4, 16), cos, cos)
    assert calls == ["rms_norm", "rms_norm", "silu_and_mul", "apply_rope"]
