"""The quantized linear (astrai/kernels/quant_ops.py and csrc/quant_linear.c) against NumPy
references built from the gguf package's own dequantization."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, dequantize
from kernel_switch import forced_plan, requires_compiler
from tiny_models import real_gguf
from torch import Tensor, nn

from astrai.kernels import Arena, Linear, LinearPath, StepGraph, kernel_plan, native, quant_blocks
from astrai.kernels import quant_ops as quant_module
from astrai.kernels.kernel_plan import active_plan
from astrai.kernels.quant_blocks import BLOCK_TYPES, pack_blocks
from astrai.kernels.quant_ops import (
    QuantizedWeight,
    lookup_rows,
    quant_linear,
    tune_quant_linears,
)

needs_kernel = pytest.mark.skipif(
    native.quant_linear is None, reason="the C quant-linear kernel was not built"
)
QTYPES = list(BLOCK_TYPES)
ISAS = ["scalar", "avx2", "avx512vnni"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (out_features, units of in_features): out not a multiple of the 16-row groups or of the
# threads' split, and an odd number of 32-blocks or super-blocks
SHAPES = [(37, 3), (130, 7), (4, 1)]
# where each type's fp16 scales lie in its GGUF block
HALVES = {
    GGMLQuantizationType.Q8_0: [0],
    GGMLQuantizationType.Q4_0: [0],
    GGMLQuantizationType.Q4_1: [0, 2],
    GGMLQuantizationType.Q5_0: [0],
    GGMLQuantizationType.Q4_K: [0, 2],
    GGMLQuantizationType.Q6_K: [208],
}


def shape_of(qtype, shape) -> tuple[int, int]:
    return shape[0], shape[1] * BLOCK_TYPES[qtype].unit_weights


def random_blocks(qtype, shape, seed: int) -> np.ndarray:
    """GGUF blocks of W [out, in]: random bytes, but fp16 scales of a real layer's size."""
    rng = np.random.default_rng(seed)
    weights, nbytes = GGML_QUANT_SIZES[qtype]
    out_features, in_features = shape
    blocks = rng.integers(0, 256, (out_features, in_features // weights, nbytes), np.uint8)
    for at in HALVES[qtype]:
        halves = (rng.standard_normal(blocks.shape[:2]) * 0.01).astype(np.float16)
        blocks[..., at : at + 2] = halves[..., None].view(np.uint8)
    return blocks.reshape(out_features, -1)


def dense_weight(blocks, qtype, shape) -> np.ndarray:
    return dequantize(blocks, qtype).reshape(shape)


def int8_blocks(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q, dx) of fp32 v [rows, blocks, 32] as the kernel quantizes it: per 32-block, dx =
    max|v| / 127 and q = round(v * (127 / max|v|)) to even, in fp32 operations as the C code."""
    amax = np.abs(v).max(-1, keepdims=True)
    dx = amax / np.float32(127)
    scale = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    return np.rint(v * scale), dx


def quantized_x(x: np.ndarray, terms: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """x as the kernel sees it (fp64), and each element's scale dx of the last term: int8
    blocks of x, and for two terms what they leave (x - dx q in fp32) at the fixed scale
    dx / 256, rounded to even and clamped to +-127, in fp32 operations as the C code."""
    v = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    q, dx = int8_blocks(v)
    seen = q.astype(np.float64) * dx
    if terms == 2:
        scale = np.divide(np.float32(256), dx, out=np.zeros_like(dx), where=dx != 0)
        q2 = np.clip(np.rint((v - (dx * q).astype(np.float32)) * scale), -127, 127)
        dx = dx / np.float32(256)
        seen = seen + q2.astype(np.float64) * dx
    return seen.reshape(x.shape), np.broadcast_to(dx, v.shape).reshape(x.shape)


def check_product(y: Tensor, x: Tensor, weight: np.ndarray, bias=None, terms: int = 1) -> None:
    """y = x W^T (+ bias) as the kernel computes it with x in terms: exact to fp32 summation
    against the product with x quantized the same way, and within the quantization's own bound
    of the product with x itself."""
    x64 = x.float().numpy().astype(np.float64)
    xq, dx = quantized_x(x.float().numpy(), terms)
    w64 = weight.astype(np.float64)
    exact, ideal = xq @ w64.T, x64 @ w64.T
    if bias is not None:
        exact, ideal = exact + bias.double().numpy(), ideal + bias.double().numpy()
    magnitude = np.abs(xq) @ np.abs(w64).T + (0 if bias is None else np.abs(bias.double().numpy()))
    rounding = 2e-6 * magnitude + 1e-30
    if y.dtype == torch.bfloat16:
        rounding = rounding + np.abs(exact) * 2.0**-8
    got = y.double().numpy()
    assert (np.abs(got - exact) <= rounding).all(), np.abs(got - exact).max()
    quantization = (dx.astype(np.float64) / 2) @ np.abs(w64).T
    assert (np.abs(got - ideal) <= quantization + rounding).all()


@pytest.fixture(params=ISAS)
def isa(request):
    """Run a test on each CPU path of the kernel, where this CPU runs it: on a plan choosing
    that path (and the path ASTRAI_LINEAR_PATH forces, if set), active for the test."""
    if native.quant_linear is None:
        pytest.skip("the C quant-linear kernel was not built")
    if request.param not in native.quant_linear.isas():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    with forced_plan(isa=request.param).active():
        yield request.param


def kernel_product(x: Tensor, weight: QuantizedWeight, bias=None, terms: int = 1) -> Tensor:
    """x W^T + b on the C kernel, on the active plan's CPU path, x quantized in terms, whatever
    the plan's paths say."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    isa = active_plan().quantized_choice(x.dtype).isa
    quant_module._run(
        LinearPath.KERNEL, out, x, weight.packed, weight.qtype, bias, terms, isa,
        kernel_plan.DEFAULT_PREFETCH,
    )  # fmt: skip
    return out


@requires_compiler
def test_kernel_is_built_where_a_compiler_is():
    assert native.quant_linear is not None, "pip install should have built it"
    assert "scalar" in native.quant_linear.isas()


@needs_kernel
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q5_1, 99, -1], ids=str)
def test_the_kernel_has_a_row_for_each_block_type_and_no_other(qtype):
    """quant_linear.c's table of block types holds quant_blocks.BLOCK_TYPES' types: a type
    without a row there (one GGML knows, or no type at all) is refused, naming those types."""
    with pytest.raises(ValueError, match=f"GGML type {int(qtype)} has no kernel") as refused:
        native.quant_linear.dequantize(0, 0, 0, 1, 256, int(qtype), False, False)
    names = re.search(r"\((.*)\)", str(refused.value)).group(1).split(", ")
    assert sorted(names) == sorted(t.name for t in BLOCK_TYPES)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_packing_keeps_every_field(qtype, shape):
    """Records hold the GGUF blocks' codes and scales, as many bytes (Q4_K: its 6-bit scales
    as bytes), rows padded to whole groups."""
    shape = shape_of(qtype, shape)
    blocks = random_blocks(qtype, shape, seed=1)
    packed = pack_blocks(blocks, qtype, shape)
    group = quant_blocks.GROUP
    padded = -(-shape[0] // group) * group * blocks.shape[1]
    widened = padded // 144 * (16 - 12) if qtype == GGMLQuantizationType.Q4_K else 0
    assert packed.nbytes == padded + widened
    fields = quant_blocks.gguf_fields(blocks, qtype, shape)
    unpacked = quant_blocks.packed_fields(packed, qtype, shape)
    assert fields.keys() == unpacked.keys()
    for name, field in fields.items():
        assert np.array_equal(unpacked[name], field), name


# sha256 (first 32 hex digits) of each type's records of random_blocks(seed=3) in SHAPES, as
# the packing of GGUF blocks decoded to codes and packed again gave them before it moved
# their bytes as they are (the layout csrc/quant_linear.c reads, unchanged).
PACKED_DIGESTS = {
    "Q8_0": "3c84a0750c23fff56b37beea4bc01f22",
    "Q4_0": "e8f92e3ddbb74019faec7575c1d88121",
    "Q4_1": "4844a905e45a3f0040530fe02f5f1ad6",
    "Q5_0": "5c4a47ec4412a4d72f434e70510d0413",
    "Q4_K": "c3598b0b3cd766252d4a61e76ab1ff85",
    "Q6_K": "3bbc5630f0d2fa8623ada06c42d40cfa",
}


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_packing_is_the_layout_the_kernel_was_written_for(qtype):
    """pack_blocks makes, bit for bit, the records it made when it went through decoded codes,
    for every type and shape (rows not whole groups included)."""
    digest = hashlib.sha256()
    for shape in SHAPES:
        shape = shape_of(qtype, shape)
        digest.update(pack_blocks(random_blocks(qtype, shape, seed=3), qtype, shape).tobytes())
    assert digest.hexdigest()[:32] == PACKED_DIGESTS[qtype.name]


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("with_kernel", [True, False], ids=["c-kernel", "gguf"])
def test_dequantize_is_gguf_exactly(monkeypatch, qtype, with_kernel):
    if with_kernel and native.quant_linear is None:
        pytest.skip("the C quant-linear kernel was not built")
    if not with_kernel:
        monkeypatch.setattr(native, "quant_linear", None)
    shape = shape_of(qtype, (37, 7))
    blocks = random_blocks(qtype, shape, seed=2)
    weight = QuantizedWeight.from_gguf(blocks, qtype, shape)
    expected = torch.from_numpy(dense_weight(blocks, qtype, shape))
    assert torch.equal(weight.dequantize(torch.float32), expected)
    assert torch.equal(weight.dequantize(torch.bfloat16), expected.bfloat16())


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("with_kernel", [True, False], ids=["c-kernel", "gguf"])
def test_embedding_in_blocks_looks_up_gguf_rows_exactly(monkeypatch, qtype, with_kernel):
    """A table kept in blocks gives the rows gguf decodes, in any order and repeated, in the
    batch's shape, for rows in every position of their 16-row group and in the last,
    padded group."""
    if with_kernel and native.quant_linear is None:
        pytest.skip("the C quant-linear kernel was not built")
    if not with_kernel:
        monkeypatch.setattr(native, "quant_linear", None)
    shape = shape_of(qtype, (37, 3))
    blocks = random_blocks(qtype, shape, seed=11)
    table = torch.from_numpy(dense_weight(blocks, qtype, shape))
    weight = QuantizedWeight.from_gguf(blocks, qtype, shape)
    ids = torch.tensor([[36, 0, 15, 16], [17, 17, 31, 32]])
    for dtype in DTYPES.values():
        rows = lookup_rows(ids, weight, dtype)
        assert rows.shape == (2, 4, shape[1]) and rows.dtype == dtype
        assert torch.equal(rows, F.embedding(ids, table.to(dtype)))


@needs_kernel
def test_embedding_in_blocks_refuses_rows_outside_its_table():
    qtype = GGMLQuantizationType.Q4_1
    shape = shape_of(qtype, (20, 1))
    table = QuantizedWeight.from_gguf(random_blocks(qtype, shape, 12), qtype, shape)
    for row in (20, -1):  # 20 lies in the padded second group: still outside the table
        with pytest.raises(IndexError, match=f"row {row} is out of range for a table of 20"):
            lookup_rows(torch.tensor([3, row]), table, torch.float32)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@needs_kernel
def test_avx512_writes_w_transposed_exactly(qtype, shape):
    """The GEMM paths' W^T on the avx512vnni path, a column's 16 rows at a time (a group cut
    short where out_features ends), equals gguf's W; a CPU without that path refuses to write
    it."""
    shape = shape_of(qtype, shape)
    blocks = random_blocks(qtype, shape, seed=3)
    packed = QuantizedWeight.from_gguf(blocks, qtype, shape).packed
    expected = torch.from_numpy(dense_weight(blocks, qtype, shape)).t()
    for dtype in DTYPES.values():
        if "avx512vnni" not in native.quant_linear.isas():
            with pytest.raises(ValueError, match="W\\^T is written on the avx512vnni path only"):
                quant_module._dequantize(packed, qtype, shape, dtype, transposed=True)
            continue
        out = torch.full(shape[::-1], float("nan"), dtype=dtype)
        quant_module._dequantize(packed, qtype, shape, dtype, out, transposed=True)
        assert torch.equal(out, expected.to(dtype))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 64])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("terms", [1, 2], ids=["int8", "int8x2"])
def test_kernel_matches_the_gguf_reference(isa, qtype, shape, rows, dtype, terms):
    shape = shape_of(qtype, shape)
    blocks = random_blocks(qtype, shape, seed=rows)
    weight = QuantizedWeight.from_gguf(blocks, qtype, shape)
    generator = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, shape[1], generator=generator) * 3).to(dtype)
    x[0, :32] = 0  # an all-zero block: dx = 0
    x[-1, 32:64] = 1.0  # a block quantized exactly: nothing left for a second term
    y = kernel_product(x, weight, terms=terms)
    assert y.dtype == dtype
    check_product(y, x, dense_weight(blocks, qtype, shape), terms=terms)


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_two_terms_are_many_times_as_exact_as_one(qtype):
    """x in two int8 terms: the products' error against x's own is a small fraction of the one
    term's (the second term's scale is at most 1/254 of the first's)."""
    shape = shape_of(qtype, (64, 4))
    blocks = random_blocks(qtype, shape, seed=8)
    weight = QuantizedWeight.from_gguf(blocks, qtype, shape)
    x = torch.randn(8, shape[1], generator=torch.Generator().manual_seed(8))
    ideal = F.linear(x.double(), torch.from_numpy(dense_weight(blocks, qtype, shape)).double())
    errors = [(kernel_product(x, weight, terms=t).double() - ideal).abs().mean() for t in (1, 2)]
    assert errors[1] < errors[0] / 50, errors


@needs_kernel
def test_the_kernel_refuses_other_term_counts():
    qtype = GGMLQuantizationType.Q8_0
    shape = shape_of(qtype, (16, 1))
    weight = QuantizedWeight.from_gguf(random_blocks(qtype, shape, 9), qtype, shape)
    with pytest.raises(ValueError, match="terms"):
        kernel_product(torch.randn(1, shape[1]), weight, terms=3)


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_the_kernel_refuses_a_weight_buffer_smaller_than_its_shape(qtype):
    # Defence in depth beside the GGUF checks: W's sizes are checked against its buffer, so no
    # shape can send the kernel reading past the end of the packed records.
    shape = shape_of(qtype, (16, 2))
    weight = QuantizedWeight.from_gguf(random_blocks(qtype, shape, 10), qtype, shape)
    lying = dataclasses.replace(weight, shape=(17, shape[1]))  # a second group of 16 rows
    with pytest.raises(ValueError, match=r"W \[17, \d+\] needs 2 groups of \d+ bytes"):
        kernel_product(torch.randn(1, shape[1]), lying)
    with pytest.raises(ValueError, match="but its packed buffer holds"):
        quant_module._dequantize(lying.packed, qtype, lying.shape, torch.float32)
    assert kernel_product(torch.randn(1, shape[1]), weight).shape == (1, 16)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("terms", [1, 2], ids=["int8", "int8x2"])
def test_bias_is_added(isa, qtype, dtype, terms):
    shape = shape_of(qtype, (13, 2))
    blocks = random_blocks(qtype, shape, seed=3)
    weight = QuantizedWeight.from_gguf(blocks, qtype, shape)
    x = torch.randn(3, shape[1]).to(dtype)
    bias = torch.randn(13).to(dtype)
    y = kernel_product(x, weight, bias, terms)
    check_product(y, x, dense_weight(blocks, qtype, shape), bias, terms)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("terms", [1, 2], ids=["int8", "int8x2"])
def test_rows_do_not_depend_on_the_batch_or_the_threads(isa, qtype, dtype, terms):
    """A row's result is bit-identical alone, in any batch (tiles of 6 rows and the rest) and
    on 1, 2 or 3 threads (groups split unevenly)."""
    shape = shape_of(qtype, (37, 3))
    weight = QuantizedWeight.from_gguf(random_blocks(qtype, shape, seed=4), qtype, shape)
    x = torch.randn(11, shape[1], generator=torch.Generator().manual_seed(4)).to(dtype)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            outs.append(kernel_product(x, weight, terms=terms))
            for row in range(len(x)):
                alone = kernel_product(x[row : row + 1], weight, terms=terms)
                assert torch.equal(alone[0], outs[-1][row])
            assert torch.equal(kernel_product(x[3:9], weight, terms=terms), outs[-1][3:9])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_kernel
def test_a_cpu_path_the_kernel_lacks_or_the_cpu_cannot_run_is_refused():
    shape = shape_of(GGMLQuantizationType.Q8_0, (16, 1))
    weight = QuantizedWeight.from_gguf(
        random_blocks(GGMLQuantizationType.Q8_0, shape, 1), GGMLQuantizationType.Q8_0, shape
    )
    with forced_plan(isa="avx1024").active(), pytest.raises(ValueError, match="no path"):
        kernel_product(torch.randn(1, shape[1]), weight)
    missing = [name for name in ISAS if name not in native.quant_linear.isas()]
    if missing:
        with forced_plan(isa=missing[0]).active(), pytest.raises(ValueError, match="cannot run"):
            kernel_product(torch.randn(1, shape[1]), weight)


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES, ids=[t.name for t in QTYPES])
def test_the_prefetch_distance_changes_no_result(monkeypatch, isa, qtype):
    monkeypatch.setenv("ASTRAI_LINEAR_PATH", "kernel")
    shape = shape_of(qtype, (37, 3))
    weight = QuantizedWeight.from_gguf(random_blocks(qtype, shape, 5), qtype, shape)
    x = torch.randn(3, shape[1], generator=torch.Generator().manual_seed(5))
    outs = []
    for distance in (0, 64, 2048, 16384):
        with forced_plan(isa=isa, prefetch=distance).active():
            outs.append(quant_linear(x, weight))
    assert all(torch.equal(out, outs[0]) for out in outs)
    for bad in (-64, 100, 16384 + 64):
        with (
            forced_plan(isa=isa, prefetch=bad).active(),
            pytest.raises(ValueError, match="not a multiple of 64 bytes in 0..16384"),
        ):
            quant_linear(x, weight)


KERNEL, GEMM, UPCAST, DOWNCAST = (
    LinearPath.KERNEL, LinearPath.GEMM, LinearPath.UPCAST, LinearPath.DOWNCAST
)  # fmt: skip


@pytest.fixture(params=list(LinearPath))
def forced_path(request, monkeypatch) -> LinearPath:
    """Run a test on each path of the op, forced as a user forces it."""
    if native.quant_linear is None:
        pytest.skip("the C quant-linear kernel was not built")
    monkeypatch.setenv("ASTRAI_LINEAR_PATH", request.param.value)
    return request.param


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("rows", [1, 70])
def test_op_on_every_path(forced_path, isa, qtype, dtype, rows):
    """The op (leading dimensions, strided x, bias) on each path and CPU path: the kernel's
    quantized product, or a GEMM on W dequantized to x's dtype (gemm), to fp32 (upcast) or to
    bf16 (downcast), the bias added after the product."""
    shape = shape_of(qtype, (21, 1))
    blocks = random_blocks(qtype, shape, seed=5)
    quantized = QuantizedWeight.from_gguf(blocks, qtype, shape)
    layer = Linear(shape[1], 21, bias=True, weight=quantized).requires_grad_(False)
    layer.bias.data = torch.randn(21).to(dtype)
    x = torch.randn(rows, 2, 2 * shape[1]).to(dtype)[:, :, ::2]  # [rows, 2, in], strided
    y = layer(x)
    assert y.shape == (rows, 2, 21) and y.dtype == dtype
    weight = torch.from_numpy(dense_weight(blocks, qtype, shape))
    if forced_path is LinearPath.KERNEL:  # the layer's default precision: x in two terms
        rows_x = x.reshape(-1, shape[1])
        check_product(y.reshape(-1, 21), rows_x, weight.numpy(), layer.bias, terms=2)
    else:
        compute = {GEMM: dtype, UPCAST: torch.float32, DOWNCAST: torch.bfloat16}[forced_path]
        product = F.linear(x.to(compute), weight.to(compute))
        expected = (product + layer.bias.to(torch.promote_types(compute, dtype))).to(dtype)
        if torch.bfloat16 in (dtype, compute):  # sums in another order may round otherwise
            torch.testing.assert_close(y, expected, atol=0.05, rtol=0.02)
            if dtype == torch.float32:  # downcast: the product a bf16 GEMM's, in bf16
                product_out = y - layer.bias
                assert torch.allclose(product_out, product_out.bfloat16().float(), atol=1e-5)
        else:  # the GEMM may sum in another order on x made contiguous than on x strided
            magnitude = F.linear(x.abs(), weight.float().abs(), layer.bias.abs())
            assert ((y - expected).abs() <= 2e-6 * magnitude).all()


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_without_the_kernel_w_is_dequantized_once(monkeypatch, qtype):
    monkeypatch.setattr(native, "quant_linear", None)
    shape = shape_of(qtype, (10, 2))
    blocks = random_blocks(qtype, shape, seed=6)
    weight = QuantizedWeight.from_gguf(blocks, qtype, shape)
    x = torch.randn(3, shape[1])
    expected = F.linear(x, torch.from_numpy(dense_weight(blocks, qtype, shape)))
    assert torch.equal(quant_linear(x, weight), expected)
    assert weight.dequantize(torch.float32) is weight.dequantize(torch.float32)


def test_types_and_shapes_without_a_kernel_are_refused():
    with pytest.raises(ValueError, match="Q5_K weights have no quantized kernel"):
        QuantizedWeight.from_gguf(np.zeros(176, np.uint8), GGMLQuantizationType.Q5_K, (1, 256))
    with pytest.raises(ValueError, match="Q4_K: in_features 576 is not a multiple of 256"):
        QuantizedWeight.from_gguf(np.zeros(324, np.uint8), GGMLQuantizationType.Q4_K, (1, 576))


# for a fake clock: seconds of a pass of the kernel on each CPU path at 1 and 4 rows (timed
# first, twice each: AVX2 wins at one row, VNNI over both), then of each path per rows (1.0
# where not given)
ISA_SECONDS = {
    1: {"scalar": 3.0, "avx2": 1.0, "avx512vnni": 1.5},
    4: {"scalar": 9.0, "avx2": 3.0, "avx512vnni": 1.5},
}
# then of the chosen path at one row, prefetching each distance (twice each): 4 KB wins
PREFETCH_SECONDS = {1024: 1.2, 2048: 1.0, 4096: 0.8}
SECONDS = {
    1: {KERNEL: 1.05, GEMM: 1.0},  # the GEMM 5 % faster: not enough to leave the kernel
    4: {KERNEL: 1.0, GEMM: 0.5},  # the GEMM twice as fast: from here on, GEMMs only
    8: {KERNEL: 0.1},  # (not timed)
    256: {GEMM: 1.0, UPCAST: 0.5, DOWNCAST: 0.25},
    1024: {GEMM: 1.0, UPCAST: 0.5, DOWNCAST: 0.25},
}


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_tuning_keeps_the_fastest_cpu_path_then_the_kernel_up_to_where_a_gemm_wins(
    monkeypatch, dtype
):
    timed = []

    def fake_time(path, weights, dtype_, terms, rows, limit, isa, prefetch=2048):
        timed.append((path, rows, isa))
        if len(timed) <= isa_timings:
            isa_distances.add(prefetch)
            return ISA_SECONDS[rows][isa]
        if len(timed) <= isa_timings + prefetch_timings:
            return PREFETCH_SECONDS[prefetch]
        path_settings.add((isa, prefetch))
        return SECONDS.get(rows, {}).get(path, 1.0)

    isa_timings = 2 * len(kernel_plan.ISA_TIMED_ROWS) * len(native.quant_linear.isas())
    prefetch_timings = 2 * len(kernel_plan.PREFETCH_DISTANCES)
    isa_distances = set()  # the CPU paths are compared at the default distance, not another
    path_settings = set()  # the paths per row bucket are timed on the chosen ones
    monkeypatch.setattr(quant_module, "_time_path", fake_time)
    weights = []
    for qtype in QTYPES:
        shape = shape_of(qtype, (8, 1))
        weights.append(QuantizedWeight.from_gguf(random_blocks(qtype, shape, 7), qtype, shape))
    chosen = tune_quant_linears(weights, dtype, batch_invariant=False)
    fastest = min(native.quant_linear.isas(), key=lambda i: sum(ISA_SECONDS[r][i] for r in (1, 4)))
    assert (chosen.isa, chosen.prefetch) == (fastest, 4096)
    assert path_settings == {(fastest, 4096)}
    assert isa_distances == {kernel_plan.DEFAULT_PREFETCH}
    assert {isa for _, _, isa in timed} == set(native.quant_linear.isas())
    large = UPCAST if dtype == torch.bfloat16 else DOWNCAST
    want = {1: KERNEL, 2: KERNEL, 256: large, 1024: large}
    assert chosen.as_dict() == {rows: want.get(rows, GEMM) for rows in kernel_plan.ROW_BUCKETS}
    assert {rows for _, rows, _ in timed[:isa_timings]} == set(kernel_plan.ISA_TIMED_ROWS)
    prefetch_timed = timed[isa_timings : isa_timings + prefetch_timings]
    assert prefetch_timed == [(KERNEL, 1, fastest)] * prefetch_timings
    path_timings = timed[isa_timings + prefetch_timings :]
    assert {rows for path, rows, _ in path_timings if path is KERNEL} == {1, 2, 4}
    assert quant_module.choose_path(torch.empty(2, 32, dtype=dtype), chosen) is KERNEL
    assert quant_module.choose_path(torch.empty(3, 32, dtype=dtype), chosen) is GEMM
    # the choice is the caller's: the untuned plan outside any engine's step is unchanged
    untuned = active_plan().quantized_choice(dtype)
    assert quant_module.choose_path(torch.empty(3, 32, dtype=dtype), untuned) is KERNEL
    # timed once per machine: a second engine, in this process or another, reads the paths,
    # the CPU path and the distance from the tuning cache
    timed.clear()
    assert tune_quant_linears(weights, dtype, batch_invariant=False) == chosen
    # unless its engine keeps the batch invariance (the default): then the kernel everywhere
    invariant = tune_quant_linears(weights, dtype)
    assert invariant == kernel_plan.LinearChoice.everywhere(KERNEL, fastest, 4096)
    assert quant_module.choose_path(torch.empty(2048, 32, dtype=dtype), invariant) is KERNEL
    assert timed == []


@functools.cache
def real_tensors() -> dict:
    return {t.name: t for t in GGUFReader(real_gguf()).tensors}


@needs_kernel
@pytest.mark.parametrize(
    "name", ["blk.0.ffn_down.weight", "blk.7.attn_k.weight", "token_embd.weight"]
)
def test_real_smollm2_tensors(isa, name):
    """A real Q4_1 layer and the Q8_0 token embedding used as the tied LM head."""
    tensor = real_tensors()[name]
    shape = (int(tensor.shape[1]), int(tensor.shape[0]))
    weight = QuantizedWeight.from_gguf(tensor.data, tensor.tensor_type, shape)
    x = torch.randn(3, shape[1], generator=torch.Generator().manual_seed(8))
    check_product(
        kernel_product(x, weight), x, dense_weight(tensor.data, tensor.tensor_type, shape)
    )


class QuantizedLayer(nn.Module):
    """One quantized linear, [rows, 64] -> [rows, 64]: kernel calls only."""

    def __init__(self, seed: int):
        super().__init__()
        shape, qtype = (64, 64), GGMLQuantizationType.Q4_1
        weight = QuantizedWeight.from_gguf(random_blocks(qtype, shape, seed), qtype, shape)
        self.proj = Linear(shape[1], shape[0], bias=False, weight=weight)

    def forward(self, x):
        return self.proj(x)


@needs_kernel
@torch.inference_mode()
def test_a_recorded_step_replays_the_kernel_on_new_inputs():
    layers = nn.ModuleList(QuantizedLayer(seed) for seed in range(3))
    static = torch.randn(3, 64)
    graph = StepGraph(Arena(max_rows=4))
    with graph.record(layers):
        out = static
        for layer in layers:
            out = layer(out)
    assert graph.valid and len(graph.calls) == 3
    for _ in range(2):
        new = torch.randn(3, 64)
        static.copy_(new)
        graph.replay(backend=None)
        want = new
        for layer in layers:
            want = layer(want)
        assert torch.equal(out, want)
