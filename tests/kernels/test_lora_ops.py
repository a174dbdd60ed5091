"""The LoRA kernel (astrai/kernels/lora_ops.py): every CPU path against each row's products in
float64, rows of every adapter and of none, ranks below the slots' width; a row's result does
not depend on the batch; a recorded call replays with each step's rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_switch import requires_compiler

from astrai.kernels import Arena, StepGraph, lora_ops, native
from astrai.kernels.lora_ops import StepRows, add_lora, kernel_takes

pytestmark = pytest.mark.skipif(native.lora is None, reason="the C extension _lora was not built")

PATHS = ["scalar", "avx2", "avx512"]
# (rows, in, out, parts, max rank, slot ranks): q/k/v-like three parts, odd sizes that leave
# tails past the vectors, and enough products for the threads to split them
SHAPES = [
    (1, 64, 96, 3, 8, [8, 4, 2]),
    (9, 72, 53, 2, 16, [16, 5, 1, 12]),
    (64, 576, 960, 3, 16, [16, 16, 8, 4]),
]
# How far from float64 a result may be, relative to the largest: fp32 sums of up to 576
# products round at a few ulp of it; bf16 rounds the low-rank product and out besides.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def assert_close(out, reference):
    """out within its dtype's rounding of the float64 reference."""
    scale = reference.abs().max().item()
    tolerance = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.double(), reference, rtol=tolerance, atol=tolerance * scale)


def stacks(in_features, out_features, parts, max_rank, ranks, dtype, generator):
    """A [slots * width, in] and B^T [slots * width, out] holding each slot's rank columns per
    part, zeros beyond, as astrai.model.lora's AdapterTable lays them out."""
    width = parts * max_rank
    a = torch.zeros(len(ranks) * width, in_features)
    bt = torch.zeros(len(ranks) * width, out_features)
    for slot, rank in enumerate(ranks):
        for part in range(parts):
            start = slot * width + part * max_rank
            a[start : start + rank] = torch.randn(rank, in_features, generator=generator) / 8
            bt[start : start + rank] = torch.randn(rank, out_features, generator=generator) / 4
    return a.to(dtype), bt.to(dtype)


def expected(out, x, a, bt, slots, scaling, parts, max_rank, ranks):
    """out + each row's scaling * (x A_s^T) B_s^T over its slot's used columns, in float64 (the
    low-rank product rounded to out's dtype, as the PyTorch products round it)."""
    width = parts * max_rank
    result = out.double().clone()
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        columns = [
            slot * width + p * max_rank + i for p in range(parts) for i in range(ranks[slot])
        ]
        low = (x[row].double() @ a[columns].double().T).to(x.dtype).double()
        result[row] += float(scaling[row]) * (low @ bt[columns].double())
    return result


def case(shape, dtype, seed, slots=None):
    rows, in_features, out_features, parts, max_rank, ranks = shape
    generator = torch.Generator().manual_seed(seed)
    a, bt = stacks(in_features, out_features, parts, max_rank, ranks, dtype, generator)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    out = torch.randn(rows, out_features, generator=generator).to(dtype)
    if slots is None:  # every slot and the base model, at random
        slots = torch.randint(-1, len(ranks), (rows,), generator=generator).numpy()
    scaling = np.array([0.5 + s for s in slots], dtype=np.float32)
    return out, x, a, bt, slots, scaling


@requires_compiler
def test_the_kernel_is_built_where_a_compiler_is():
    assert native.lora is not None, "pip install should have built it"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_each_path_adds_every_row_s_own_adapter(path, dtype, shape):
    if path not in native.lora.paths():
        pytest.skip(f"this CPU does not run the {path} path")
    out, x, a, bt, slots, scaling = case(shape, dtype, seed=shape[0])
    if shape[0] > 1:  # the case holds rows of the base model and of several adapters
        assert -1 in slots and len(set(slots.tolist())) > 2
    _, _, parts, max_rank, ranks = shape[1:]
    reference = expected(out, x, a, bt, slots, scaling, parts, max_rank, ranks)
    rows = StepRows()
    rows.set(slots, scaling)
    before = out.clone()
    add_lora(out, x, a, bt, rows, torch.tensor(ranks), max_rank, path)
    assert_close(out, reference)
    untouched = torch.from_numpy(slots < 0)
    assert torch.equal(out[untouched], before[untouched])


@pytest.mark.parametrize("path", PATHS)
def test_one_adapter_for_every_row(path):
    if path not in native.lora.paths():
        pytest.skip(f"this CPU does not run the {path} path")
    shape = SHAPES[1]
    out, x, a, bt, slots, scaling = case(shape, torch.float32, 3, slots=np.full(9, 3))
    _, _, parts, max_rank, ranks = shape[1:]
    reference = expected(out, x, a, bt, slots, scaling, parts, max_rank, ranks)
    rows = StepRows()
    rows.set(slots, scaling)
    add_lora(out, x, a, bt, rows, torch.tensor(ranks), max_rank, path)
    assert_close(out, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_s_result_does_not_depend_on_the_batch(dtype):
    """Each row alone gives the bits it gives among 64 rows of other adapters, where the
    threads split the work."""
    shape = SHAPES[2]
    out, x, a, bt, slots, scaling = case(shape, dtype, seed=5)
    ranks, max_rank = torch.tensor(shape[5]), shape[4]
    batched, rows = out.clone(), StepRows()
    rows.set(slots, scaling)
    add_lora(batched, x, a, bt, rows, ranks, max_rank)
    for row in (0, 17, 63):
        alone = out[row : row + 1].clone()
        rows.set(slots[row : row + 1], scaling[row : row + 1])
        add_lora(alone, x[row : row + 1], a, bt, rows, ranks, max_rank)
        assert torch.equal(alone[0], batched[row])


def test_a_recorded_call_replays_with_each_step_s_rows():
    """The rows' slots are the step's input: a replay after set() adds the new step's adapters,
    as a fresh call does."""
    shape = SHAPES[1]
    out, x, a, bt, slots, scaling = case(shape, torch.float32, seed=7)
    ranks, max_rank = torch.tensor(shape[5]), shape[4]
    rows, graph = StepRows(), StepGraph(Arena(16))
    rows.set(slots, scaling)
    target = out.clone()
    with graph.record([]):
        add_lora(target, x, a, bt, rows, ranks, max_rank)
    assert graph.valid and len(graph.calls) == 1
    first_step = target.clone()
    rows.set(np.roll(slots, 1), np.full(len(slots), 2.0, dtype=np.float32))
    target.copy_(out)
    graph.replay(backend=None)
    fresh = out.clone()
    add_lora(fresh, x, a, bt, rows, ranks, max_rank)
    assert torch.equal(target, fresh)
    assert not torch.equal(target, first_step)


def test_the_rule_and_the_refusals():
    out, x, a, bt, slots, scaling = case(SHAPES[1], torch.float32, seed=1)
    ranks, max_rank = torch.tensor(SHAPES[1][5]), SHAPES[1][4]
    assert kernel_takes(x, out, a, bt)
    assert not kernel_takes(x.half(), out.half(), a.half(), bt.half())  # fp16: PyTorch's
    assert not kernel_takes(x, out[:, :32], a, bt)
    assert not kernel_takes(x, out, a.bfloat16(), bt)
    rows = StepRows()
    rows.set(np.zeros(2, dtype=np.int64), np.ones(2, dtype=np.float32))
    with pytest.raises(ValueError, match="the step set 2 rows' adapters, x has 9 rows"):
        add_lora(out, x, a, bt, rows, ranks, max_rank)
    rows.set(np.full(9, 4), scaling)
    with pytest.raises(ValueError, match="row 0 takes slot 4, not one of the 4"):
        add_lora(out, x, a, bt, rows, ranks, max_rank)
    rows.set(slots, scaling)
    with pytest.raises(ValueError, match="no path avx9 on this CPU"):
        add_lora(out, x, a, bt, rows, ranks, max_rank, "avx9")


@pytest.mark.parametrize("fastest", ["slowest first", "widest"])
def test_the_path_is_chosen_by_timing(monkeypatch, fastest):
    """As the other kernels' paths are: measured on the stacks, not read from CPU flags."""
    paths = native.lora.paths()
    if len(paths) < 2:
        pytest.skip("this CPU runs the scalar path only")
    winner = paths[0] if fastest == "slowest first" else paths[-1]
    monkeypatch.setattr(lora_ops, "_seconds", lambda step, path, limit: 0.1 + (path != winner))
    out, x, a, bt, slots, scaling = case(SHAPES[1], torch.float32, seed=3)
    assert lora_ops.fastest_path(a, bt, len(SHAPES[1][5]), SHAPES[1][4]) == winner
