from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from kernel_switch import forced_plan, requires_compiler

from astrai.kernels import (
    SKINNY_MAX_ROWS,
    LinearPath,
    kernel_plan,
    linear,
    native,
    tune_linears,
)
from astrai.kernels import linear_ops as linear_module
from astrai.kernels.kernel_plan import active_plan
from astrai.kernels.linear_ops import choose_path

needs_kernel = pytest.mark.skipif(
    native.skinny_linear is None, reason="the C skinny-linear kernel was not built"
)


def runs_skinny(x, weight, bias=None) -> bool:
    """Whether linear(x, weight, bias) takes the skinny kernel."""
    choice = active_plan().dense_choice(x.dtype)
    return (
        native.cpu_kernel_may_take(x, weight, bias)
        and choose_path(x.reshape(-1, x.shape[-1]), weight, bias, choice) is LinearPath.KERNEL
    )


@pytest.fixture(params=list(LinearPath))
def forced_path(request, monkeypatch) -> LinearPath:
    """Run a test on each path, forced as a user forces it."""
    if request.param is LinearPath.KERNEL and native.skinny_linear is None:
        pytest.skip("the C skinny-linear kernel was not built")
    monkeypatch.setenv("ASTRAI_LINEAR_PATH", request.param.value)
    return request.param


BF16_PATHS = ("vec8", "avx512", "avx512bf16")


@pytest.fixture(params=BF16_PATHS)
def bf16_path(request):
    """Run a test on each CPU path of the kernel's bf16 products, where this CPU runs it: on a
    plan choosing that path, active for the test."""
    if native.skinny_linear is None:
        pytest.skip("the C skinny-linear kernel was not built")
    if request.param not in native.skinny_linear.bf16_paths():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    with forced_plan(bf16_path=request.param).active():
        yield request.param


@pytest.fixture
def kernel_calls(monkeypatch) -> list[tuple]:
    """The arguments of every skinny-kernel call the test makes."""
    calls: list[tuple] = []
    kernel = native.skinny_linear

    def recorded(*args):
        calls.append(args)
        return kernel.linear(*args)

    monkeypatch.setattr(
        native, "skinny_linear", SimpleNamespace(linear=recorded, bf16_paths=kernel.bf16_paths)
    )
    return calls


@requires_compiler
def test_kernel_is_built_where_a_compiler_is():
    assert native.skinny_linear is not None, "pip install should have built it"
    assert "vec8" in native.skinny_linear.bf16_paths()


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
def test_skinny_rows_do_not_depend_on_the_batch_or_the_threads(bf16_path, dtype):
    """Each output is one dot product summed in a fixed order, however the threads split W's
    rows (into uneven parts here) and whatever other rows of x share the call, on every bf16
    path (fp32 has one)."""
    if dtype == torch.float32 and bf16_path != "vec8":
        pytest.skip("fp32 products have one path")
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(9, 48, generator=generator).to(dtype)
    weight = torch.randn(37, 48, generator=generator).to(dtype)
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


@pytest.mark.parametrize("rows", [1, 2, 7, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_products_sum_in_fp32_on_every_path(forced_path, rows, with_bias):
    """Each path computes what a bf16 GEMM does; the kernel takes what it can, up to its rows."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=generator).bfloat16()
    weight = torch.randn(13, 48, generator=generator).bfloat16()
    bias = torch.randn(13, generator=generator).bfloat16() if with_bias else None
    takes_kernel = forced_path is LinearPath.KERNEL and rows <= SKINNY_MAX_ROWS
    assert runs_skinny(x, weight, bias) == takes_kernel
    out = linear(x, weight, bias)
    assert out.dtype == torch.bfloat16
    # fp32 sums in another order can round to the neighbouring bf16
    torch.testing.assert_close(out, bf16_product(x, weight, bias), rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp32_and_bf16_products_match_f_linear_on_every_path(forced_path, dtype):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 32, generator=generator).to(dtype)
    weight = torch.randn(24, 32, generator=generator).to(dtype)
    bias = torch.randn(24, generator=generator).to(dtype)
    out = linear(x, weight, bias)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(
        out.float(),
        F.linear(x.float(), weight.float(), bias.float()),
        **({"atol": 0.05, "rtol": 0.02} if dtype == torch.bfloat16 else {}),
    )


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 9, SKINNY_MAX_ROWS])
@pytest.mark.parametrize("in_features", [16, 64, 80, 576])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_kernel_paths_sum_in_fp32(bf16_path, kernel_calls, rows, in_features, with_bias):
    """Each bf16 path computes what a bf16 GEMM does, rows of 32 and a last run of 16 alike."""
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    weight = torch.randn(37, in_features, generator=generator).bfloat16()
    bias = torch.randn(37, generator=generator).bfloat16() if with_bias else None
    assert runs_skinny(x, weight, bias)
    out = linear(x, weight, bias)
    assert [call[-2] for call in kernel_calls] == [bf16_path]  # the plan's path, and no other
    torch.testing.assert_close(out, bf16_product(x, weight, bias), rtol=8e-3, atol=1e-2)


@needs_kernel
def test_the_bf16_prefetch_distance_changes_no_result(bf16_path, kernel_calls):
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(5, 96, generator=generator).bfloat16()
    weight = torch.randn(70, 96, generator=generator).bfloat16()
    outs = []
    distances = (0, 64, 2048, 16384)
    for distance in distances:
        with forced_plan(bf16_path=bf16_path, prefetch=distance).active():
            outs.append(linear(x, weight))
    assert [call[-1] for call in kernel_calls] == list(distances)
    assert all(torch.equal(out, outs[0]) for out in outs)
    for bad in (-64, 100, 16384 + 64):
        with (
            forced_plan(bf16_path=bf16_path, prefetch=bad).active(),
            pytest.raises(ValueError, match="not a multiple of 64 bytes in 0..16384"),
        ):
            linear(x, weight)


@needs_kernel
def test_a_bf16_path_the_kernel_lacks_or_the_cpu_cannot_run_is_refused():
    x, weight = torch.randn(1, 32).bfloat16(), torch.randn(4, 32).bfloat16()
    with (
        forced_plan(bf16_path="avx1024").active(),
        pytest.raises(ValueError, match="no bf16 path avx1024"),
    ):
        linear(x, weight)
    missing = [name for name in BF16_PATHS if name not in native.skinny_linear.bf16_paths()]
    if missing:
        with (
            forced_plan(bf16_path=missing[0]).active(),
            pytest.raises(ValueError, match="cannot run"),
        ):
            linear(x, weight)


def test_a_forced_path_that_does_not_exist_is_refused(monkeypatch):
    monkeypatch.setenv("ASTRAI_LINEAR_PATH", "fastest")
    with pytest.raises(ValueError, match="ASTRAI_LINEAR_PATH='fastest': use one of kernel, gemm"):
        linear(torch.randn(1, 16), torch.randn(4, 16))


KERNEL, GEMM, UPCAST = LinearPath.KERNEL, LinearPath.GEMM, LinearPath.UPCAST
# rows -> path -> seconds a pass takes, for a fake clock (1.0 where not given)
SECONDS = {
    1: {KERNEL: 1.0, GEMM: 0.5},  # the GEMM twice as fast
    4: {KERNEL: 1.05, GEMM: 1.0},  # the GEMM 5 % faster: not enough to leave the kernel
    16: {KERNEL: 0.5, GEMM: 1.0},
    256: {GEMM: 1.0, UPCAST: 0.5},
    1024: {GEMM: 1.0, UPCAST: 0.5},
}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tuning_keeps_the_fastest_path_of_each_row_bucket(monkeypatch, dtype):
    """Up to the kernel's rows, the kernel against the GEMM on every weight, the kernel kept
    unless the GEMM is 10 % faster; beyond, the GEMMs (bf16: also upcast) on a layer's."""
    timed: list[tuple[LinearPath, int, int]] = []

    def fake_time(path, weights, rows, limit, bf16_path="vec8", prefetch=2048):
        timed.append((path, rows, len(weights)))
        return SECONDS.get(rows, {}).get(path, 1.0)

    monkeypatch.setattr(linear_module, "_time_path", fake_time)
    weights = [torch.randn(32, 32).to(dtype) for _ in range(6)]
    chosen = tune_linears(weights)
    large = {GEMM, UPCAST} if dtype == torch.bfloat16 else {GEMM}
    for rows in kernel_plan.ROW_BUCKETS:
        paths = {(p, n) for p, r, n in timed if r == rows}
        # a lone candidate (fp32's GEMM beyond the kernel's rows) is not timed
        assert paths == (
            {(KERNEL, 6), (GEMM, 6)}
            if rows <= SKINNY_MAX_ROWS
            else {(p, 4) for p in large if len(large) > 1}
        )
    large_path = UPCAST if dtype == torch.bfloat16 else GEMM
    want = {1: GEMM, 256: large_path, 1024: large_path}
    assert chosen.as_dict() == {rows: want.get(rows, KERNEL) for rows in kernel_plan.ROW_BUCKETS}
    assert choose_path(torch.randn(1, 32).to(dtype), weights[0], None, chosen) is GEMM
    assert choose_path(torch.randn(3, 32).to(dtype), weights[0], None, chosen) is KERNEL
    # the choice is the caller's: nothing outside it changed
    untuned = active_plan().dense_choice(dtype)
    assert choose_path(torch.randn(1, 32).to(dtype), weights[0], None, untuned) is KERNEL
    # timed once per machine: a second engine, in this process or another, reads the tuning
    # cache
    timed.clear()
    assert tune_linears(weights) == chosen
    assert timed == []


# bf16 kernel path -> prefetch distance -> seconds a pass of ISA_TIMED_ROWS takes
BF16_SECONDS = {
    "vec8": {2048: 1.0},
    "avx512": {1024: 0.5, 2048: 0.6, 4096: 0.7},
    "avx512bf16": {1024: 0.8, 2048: 0.7, 4096: 0.4},
}


@needs_kernel
def test_tuning_keeps_the_fastest_bf16_kernel_path_then_its_prefetch_distance(monkeypatch):
    """The bf16 paths are timed at the default distance over ISA_TIMED_ROWS, on the weights the
    kernel takes; then the winner's distances (avx512 at 2048, then 1024 here: avx512bf16's
    4096 is never tried); both are set, and remembered."""
    kernel = native.skinny_linear
    paths = kernel.bf16_paths()
    if "avx512" not in paths:
        pytest.skip("this CPU runs no AVX-512 bf16 path: vec8 alone is not timed")
    timed: list[tuple[str, int, int, int]] = []

    def fake_time(path, weights, rows, limit, bf16_path="vec8", prefetch=2048):
        if path is not KERNEL:
            return 1.0
        setting = (bf16_path, prefetch)
        timed.append((*setting, rows, len(weights)))
        return BF16_SECONDS[setting[0]].get(setting[1], 9.0) / len(kernel_plan.ISA_TIMED_ROWS)

    monkeypatch.setattr(linear_module, "_time_path", fake_time)
    # the kernel takes rows of 16 bf16 at a time: the 24-wide weight is left out of its timing
    weights = [torch.randn(32, 32).bfloat16() for _ in range(3)] + [torch.randn(8, 24).bfloat16()]
    chosen = tune_linears(weights)
    path_timings = 2 * len(paths) * len(kernel_plan.ISA_TIMED_ROWS)  # each twice, in turn
    distance_timings = 2 * len(kernel_plan.PREFETCH_DISTANCES) * len(kernel_plan.ISA_TIMED_ROWS)
    by_path, by_distance = timed[:path_timings], timed[path_timings:][:distance_timings]
    default = kernel_plan.DEFAULT_PREFETCH
    assert {(p, d) for p, d, _, _ in by_path} == {(p, default) for p in paths}
    assert {(p, d) for p, d, _, _ in by_distance} == {
        ("avx512", d) for d in kernel_plan.PREFETCH_DISTANCES
    }
    assert {rows for _, _, rows, _ in by_path + by_distance} == set(kernel_plan.ISA_TIMED_ROWS)
    assert {n for _, _, _, n in by_path + by_distance} == {3}
    assert (chosen.isa, chosen.prefetch) == ("avx512", 1024)
    # a second engine reads both from the tuning cache
    timed.clear()
    assert tune_linears(weights) == chosen
    assert timed == []


def test_tuning_leaves_the_callers_random_state_alone():
    weight = torch.randn(16, 32).bfloat16()
    torch.manual_seed(7)
    tune_linears([weight])
    after_tuning = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(torch.rand(3), after_tuning)


def test_without_the_kernel_tuning_times_the_gemms_alone(monkeypatch):
    monkeypatch.setattr(native, "skinny_linear", None)
    monkeypatch.setattr(linear_module, "_time_path", lambda path, w, rows, limit, **setting: 1.0)
    chosen = tune_linears([torch.randn(32, 32).bfloat16()])
    assert set(chosen.paths) == {GEMM}


def test_a_pass_slower_than_the_best_so_far_stops_early():
    weights = [torch.randn(64, 64) for _ in range(8)]
    assert linear_module._time_path(GEMM, weights, 4, limit=0.0) == float("inf")
    assert linear_module._time_path(GEMM, weights, 4, limit=10.0) < 10.0
