from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_switch import requires_compiler

from astrai.model import linear as linear_module
from astrai.model.linear import SKINNY_MAX_ROWS, SLOW_BF16_MATMUL, Linear, linear, runs_skinny

needs_kernel = pytest.mark.skipif(
    linear_module._skinny_linear is None, reason="the C skinny-linear kernel was not built"
)


@requires_compiler
def test_kernel_is_built_where_a_compiler_is():
    assert linear_module._skinny_linear is not None, "pip install should have built it"


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 7, SKINNY_MAX_ROWS])
@pytest.mark.parametrize(("in_features", "out_features"), [(8, 5), (24, 8), (64, 13)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_kernel_matches_f_linear(rows, in_features, out_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 100 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    assert runs_skinny(x, weight, bias)
    torch.testing.assert_close(linear(x, weight, bias), F.linear(x, weight, bias))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_skinny_rows_do_not_depend_on_the_batch_or_the_threads(dtype):
    """Each output is one dot product summed in a fixed order, however the threads split W's
    rows (into uneven parts here) and whatever other rows of x share the call."""
    if dtype not in linear_module.KERNEL_DTYPES:
        pytest.skip("PyTorch has fast bf16 GEMMs here: bf16 linears stay on PyTorch")
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(9, 32, generator=generator).to(dtype)
    weight = torch.randn(37, 32, generator=generator).to(dtype)
    assert runs_skinny(x, weight)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            outs.append(linear(x, weight))
            for row in range(len(x)):
                assert torch.equal(linear(x[row : row + 1], weight)[0], outs[-1][row])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(
        outs[0].float(),
        F.linear(x.float(), weight.float()),
        **({"atol": 0.05, "rtol": 0.02} if dtype == torch.bfloat16 else {}),
    )


@needs_kernel
def test_leading_dimensions_and_strided_input():
    x = torch.randn(3, 2, 32)[:, :, :16]  # [3, 2, 16], not contiguous
    weight = torch.randn(6, 16)
    assert runs_skinny(x, weight)
    out = linear(x, weight)
    assert out.shape == (3, 2, 6)
    torch.testing.assert_close(out, F.linear(x, weight))


@pytest.mark.parametrize(
    "case",
    [
        "too many rows",
        "in_features not a multiple of 8",
        "bf16 in_features not a multiple of 16",
        "float16",
        "needs gradients",
    ],
)
def test_products_the_kernel_cannot_take_stay_on_f_linear(case):
    x, weight = torch.randn(4, 16), torch.randn(8, 16)
    if case == "too many rows":
        x = torch.randn(SKINNY_MAX_ROWS + 1, 16)
    elif case == "in_features not a multiple of 8":
        x, weight = torch.randn(4, 12), torch.randn(8, 12)
    elif case == "bf16 in_features not a multiple of 16":
        x, weight = torch.randn(4, 24).bfloat16(), torch.randn(8, 24).bfloat16()
    elif case == "float16":
        x, weight = x.half(), weight.half()
    else:
        weight.requires_grad_()
    assert not runs_skinny(x, weight)
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight))


def bf16_product(x, weight, bias=None):
    """What a bf16 GEMM computes: exact products, fp32 sums, one rounding to bf16."""
    bias = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), bias).bfloat16()


@pytest.mark.skipif(not SLOW_BF16_MATMUL, reason="PyTorch has fast bf16 GEMMs on this CPU")
@pytest.mark.parametrize("rows", [1, 2, 7, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_products_sum_in_fp32_where_bf16_gemms_are_slow(rows, with_bias):
    """Few rows on the kernel reading bf16 weights, more as an fp32 GEMM on upcast copies."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=generator).bfloat16()
    weight = torch.randn(13, 48, generator=generator).bfloat16()
    bias = torch.randn(13, generator=generator).bfloat16() if with_bias else None
    assert runs_skinny(x, weight, bias) == (
        linear_module._skinny_linear is not None and rows <= SKINNY_MAX_ROWS
    )
    out = linear(x, weight, bias)
    assert out.dtype == torch.bfloat16
    # fp32 sums in another order can round to the neighbouring bf16
    torch.testing.assert_close(out, bf16_product(x, weight, bias), rtol=8e-3, atol=1e-2)


def test_linear_module_keeps_nn_linear_parameters_and_trains():
    layer = Linear(16, 4)
    assert set(layer.state_dict()) == {"weight", "bias"}
    layer(torch.randn(2, 16)).sum().backward()
    assert layer.weight.grad is not None
