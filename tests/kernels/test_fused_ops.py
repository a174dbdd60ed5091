"""The fused small ops: each C kernel against the PyTorch formula it replaces, and fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_switch import CountingKernels, kernel_or_fallback, requires_compiler

from astrai.kernels import (
    add_rms_norm,
    apply_rope,
    gelu_tanh_and_mul,
    native,
    rms_norm,
    silu_and_mul,
)
from astrai.kernels.fused_ops import gather_rows

# Each gated activation (SwiGLU, GeGLU): the op, the PyTorch function of the gate it replaces,
# and how far from it the fallback and the kernel may be. PyTorch's fp32 GELU, 0.5 g (1 +
# tanh(u)), cancels at negative gates and keeps about 1e-7 of the gate there, where the
# kernel's g * sigmoid(2u) does not: the kernel is held to GELU in float64 instead (and the
# bf16 test keeps its gates out of that tail, where PyTorch's bf16 GELU is that fp32 rounded).
GATED = {
    "silu": (silu_and_mul, F.silu, 1e-6),
    "gelu_tanh": (
        gelu_tanh_and_mul,
        lambda gate: F.gelu(gate.double(), approximate="tanh").to(gate.dtype),
        1e-4,
    ),
}


@pytest.fixture(params=["c-kernel", "pytorch"])
def backend(request, monkeypatch):
    """Run a test on the C kernels, then on the PyTorch formulas alone; in the first case the
    test fails unless a kernel ran."""
    name = kernel_or_fallback(request, monkeypatch, "fused_ops")
    calls: list[str] = []
    if name == "c-kernel":
        monkeypatch.setattr(native, "fused_ops", CountingKernels(native.fused_ops, calls))
    yield name
    assert bool(calls) == (name == "c-kernel"), f"kernels called: {calls}"


def transformers_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward for an fp32 x."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@requires_compiler
def test_kernels_are_built_where_a_compiler_is():
    assert native.fused_ops is not None, "pip install should have built them"


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 5, 32), (300, 24)])
def test_rms_norm_matches_transformers(shape, backend):
    generator = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=generator) * 4
    weight = torch.randn(shape[-1], generator=generator)
    expected = transformers_rms_norm(x, weight, 1e-5)
    if backend == "pytorch":
        # F.rms_norm computes transformers' formula op for op
        assert torch.equal(rms_norm(x, weight, 1e-5), expected)
    else:
        # the kernel sums the squares in another order: a few ulp apart
        torch.testing.assert_close(rms_norm(x, weight, 1e-5), expected, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_add_rms_norm_returns_the_exact_sum_and_its_norm(rows, backend):
    generator = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 48, generator=generator) for _ in range(2))
    weight = torch.randn(48, generator=generator)
    normed, total = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(normed, transformers_rms_norm(x + residual, weight, 1e-6))


@pytest.mark.parametrize("activation", list(GATED))
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
def test_gated_mul_matches_pytorch(rows, activation, backend):
    gated_mul, act, atol = GATED[activation]
    generator = torch.Generator().manual_seed(rows)
    for scale in (30, 1):  # deep in both tails, and near 0
        gate_up = torch.randn(rows, 2 * 40, generator=generator) * scale
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(gated_mul(gate_up), act(gate) * up, rtol=2e-6, atol=atol)


@pytest.mark.parametrize("activation", list(GATED))
def test_gated_mul_at_the_edges_of_exp(activation, backend):
    gated_mul, act, _ = GATED[activation]
    gate = torch.tensor([-1e4, -100.0, -87.0, -1e-3, 0.0, 1e-3, 87.0, 100.0] * 2)
    got = gated_mul(torch.cat((gate, torch.ones_like(gate)))[None])[0]
    torch.testing.assert_close(got, act(gate), rtol=2e-6, atol=1e-30)


@pytest.mark.skipif(native.fused_ops is None, reason="the C fused-ops kernels were not built")
def test_gelu_tanh_kernel_keeps_the_negative_tail_pytorch_cancels():
    gate = torch.linspace(-6, 0, 64)
    got = gelu_tanh_and_mul(torch.cat((gate, torch.ones_like(gate)))[None])[0]
    exact = F.gelu(gate.double(), approximate="tanh").float()
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-30)
    assert torch.isfinite(got).all()


def test_rope_is_bit_identical_to_transformers(backend):
    assert_rope_is_transformers(torch.float32)


def test_bf16_rope_is_bit_identical_to_transformers(backend):
    """The bf16 kernel rounds both products and their sum, as transformers' ops do."""
    assert_rope_is_transformers(torch.bfloat16)


def assert_rope_is_transformers(dtype: torch.dtype) -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    num_tokens, heads, head_dim = 5, 3, 16
    q = torch.randn(num_tokens, heads, head_dim).to(dtype)
    angles = torch.randn(num_tokens, head_dim // 2)
    cos, sin = angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]
    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    # transformers rotates [batch, heads, tokens, head_dim] with cos/sin [batch, tokens, head_dim]
    expected, _ = llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], q.transpose(0, 1)[None], full_cos[None, :, 0], full_sin[None, :, 0]
    )
    ours = apply_rope(q, full_cos, torch.cat((-sin, sin), -1))
    assert torch.equal(ours, expected[0].transpose(0, 1))


def test_rope_reads_heads_out_of_a_wider_row(backend):
    """q and k heads sliced out of the fused qkv projection: rows lie further apart."""
    qkv = torch.randn(4, 5 * 16)
    qk = qkv[:, : 3 * 16].view(4, 3, 16)
    cos, signed_sin = torch.randn(4, 1, 16), torch.randn(4, 1, 16)
    expected = qk * cos + qk.roll(8, dims=-1) * signed_sin
    assert torch.equal(apply_rope(qk, cos, signed_sin), expected)


def assert_rounds_as_pytorch_bf16(got: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 computed in fp32 and rounded where PyTorch rounds: equal but for a last place where
    an fp32 sum or exp, taken in another order, lands beside a rounding boundary."""
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=1e-6)
    assert (got == expected).float().mean() >= 0.98


def transformers_bf16_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward for a bf16 x: normalise in fp32, round, multiply by the weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).bfloat16()


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_bf16_rms_norms_round_as_transformers(rows, backend):
    generator = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 64, generator=generator).bfloat16() for _ in range(2))
    weight = torch.randn(64, generator=generator).bfloat16()
    normed, total = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, x + residual)  # one rounding of an exact fp32 sum
    assert_rounds_as_pytorch_bf16(normed, transformers_bf16_rms_norm(total, weight, 1e-6))
    assert_rounds_as_pytorch_bf16(
        rms_norm(x, weight, 1e-6), transformers_bf16_rms_norm(x, weight, 1e-6)
    )


@pytest.mark.parametrize("activation", list(GATED))
@pytest.mark.parametrize("rows", [1, 64])
def test_bf16_gated_mul_rounds_as_pytorch(rows, activation, backend):
    gated_mul, act, _ = GATED[activation]
    generator = torch.Generator().manual_seed(rows)
    scale = 8 if activation == "silu" else 1.5
    gate_up = (torch.randn(rows, 2 * 48, generator=generator) * scale).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    assert_rounds_as_pytorch_bf16(gated_mul(gate_up), act(gate) * up)


@pytest.mark.parametrize("case", ["float16", "needs gradients", "not a multiple of 8"])
def test_inputs_the_kernels_cannot_take_use_the_pytorch_formulas(case, monkeypatch):
    calls = []
    if native.fused_ops is not None:
        monkeypatch.setattr(native, "fused_ops", CountingKernels(native.fused_ops, calls))
    dim = 12 if case == "not a multiple of 8" else 16
    x, residual, weight = torch.randn(3, dim), torch.randn(3, dim), torch.randn(dim)
    if case == "float16":
        x, residual, weight = x.half(), residual.half(), weight.half()
    elif case == "needs gradients":
        weight.requires_grad_()
    normed, total = add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(total, x + residual)
    torch.testing.assert_close(
        normed,
        transformers_rms_norm((x + residual).float(), weight.float(), 1e-5).to(x.dtype),
        rtol=1e-2 if case == "float16" else 1e-5,
        atol=1e-2 if case == "float16" else 1e-5,
    )
    gate_up = torch.randn(3, 2 * dim, requires_grad=case == "needs gradients").to(x.dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate) * up)
    assert calls == []


def test_every_kernel_op_has_a_fake_implementation_for_tracing():
    """torch.compile and fake tensors see astrai's ops with the shapes they return."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, weight, norm = torch.empty(3, 32), torch.empty(16, 32), torch.empty(32)
        qk, cos = torch.empty(3, 6, 8), torch.empty(3, 1, 8)
        assert torch.ops.astrai.linear(x, weight, None, "kernel", "vec8", 2048).shape == (3, 16)
        assert torch.ops.astrai.rms_norm(x, norm, 1e-5).shape == (3, 32)
        assert [t.shape for t in torch.ops.astrai.add_rms_norm(x, x, norm, 1e-5)] == [(3, 32)] * 2
        assert torch.ops.astrai.silu_and_mul(x).shape == (3, 16)
        assert torch.ops.astrai.gelu_tanh_and_mul(x).shape == (3, 16)
        assert torch.ops.astrai.rope(qk, cos, cos).shape == (3, 6, 8)


@pytest.mark.skipif(native.fused_ops is None, reason="the C fused-ops kernels were not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_rows_are_index_selects_and_an_index_outside_is_refused(dtype):
    table = torch.randn(10, 1, 6).to(dtype)
    index = torch.tensor([3, 0, 9, 3])
    assert torch.equal(gather_rows(table, index), table.index_select(0, index))
    with pytest.raises(IndexError, match="row 10 of a table of 10 rows"):
        gather_rows(table, torch.tensor([2, 10]))
