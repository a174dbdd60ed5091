"""Each engine's KernelPlan: its own kernel choices, which no other engine in the process (a
second engine, a draft model) changes."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from kernel_switch import CountingKernels, forced_plan
from tiny_models import make_engine, write_hf_model

from astrai.inference import GenerationParams
from astrai.kernels import KernelPlan, LinearPath, linear_ops, native, quant_ops
from astrai.kernels.kernel_plan import ROW_BUCKETS, active_plan, widest_quantized_isa
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away", "1 2 3 4", "Hello"]
GREEDY = GenerationParams(max_tokens=10, temperature=0.0, ignore_eos=True)
KERNEL, GEMM = LinearPath.KERNEL, LinearPath.GEMM


def test_a_plan_is_active_on_its_thread_only_and_inside_only():
    dtype = torch.float32
    untuned = active_plan().dense_choice(dtype)
    outer, inner = forced_plan(GEMM), forced_plan(LinearPath.UPCAST)
    seen_elsewhere = []
    with outer.active():
        assert active_plan() is outer
        with inner.active():
            assert active_plan() is inner
        assert active_plan() is outer
        other = threading.Thread(target=lambda: seen_elsewhere.append(active_plan()))
        other.start()
        other.join()
    assert seen_elsewhere[0].dense_choice(dtype) == untuned
    assert active_plan().dense_choice(dtype) == untuned


def test_a_plan_refuses_an_unknown_activation_precision():
    with pytest.raises(ValueError, match="activation precision 'int4': use one of int8x2, int8"):
        KernelPlan(activation_precision="int4")


@pytest.mark.skipif(native.quant_linear is None, reason="the quantized kernel is not built")
def test_two_engines_with_other_settings_in_one_process_keep_their_own_paths(
    monkeypatch, llama_dir
):
    """An engine that keeps batch invariance (the kernel at every row count, x in one int8
    term) and one that does not (a GEMM beyond one row, as the faked timing finds, x in two
    terms), built one after the other on one model and run in turns: each runs its own
    paths and answers as the same engine alone does."""
    gemm_beyond_one_row = [KERNEL.value] + [GEMM.value] * (len(ROW_BUCKETS) - 1)
    monkeypatch.setattr(
        quant_ops,
        "_fastest_isa_and_paths",
        lambda weights, dtype, terms: [widest_quantized_isa(), 2048, *gemm_beyond_one_row],
    )
    model = AutoModel.from_pretrained(llama_dir, quantization="q8_0")
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    settings = {
        "invariant": {"batch_invariant": True, "activation_precision": "int8"},
        "fastest": {"batch_invariant": False, "activation_precision": "int8x2"},
    }

    def greedy(engine) -> list[list[int]]:
        return [result.token_ids for result in engine.generate_results(PROMPTS, GREEDY)]

    alone = {}
    for name, setting in settings.items():
        with make_engine(model, tokenizer, **setting) as engine:
            alone[name] = greedy(engine)

    calls: list[str] = []
    with (
        make_engine(model, tokenizer, **settings["invariant"]) as invariant,
        make_engine(model, tokenizer, **settings["fastest"]) as fastest,
    ):
        monkeypatch.setattr(native, "quant_linear", CountingKernels(native.quant_linear, calls))
        invariant_plan = invariant.scheduler.executor.kernel_plan
        fastest_plan = fastest.scheduler.executor.kernel_plan
        assert set(invariant_plan.quantized[torch.float32].paths) == {KERNEL}
        assert fastest_plan.quantized[torch.float32].paths[1:] == (GEMM,) * 8
        assert (invariant_plan.activation_terms, fastest_plan.activation_terms) == (1, 2)
        # the kernel's product is "linear"; a GEMM path dequantizes W ("dequantize") first
        for engine, name, kernel_calls in [
            (invariant, "invariant", {"linear"}),
            (fastest, "fastest", {"dequantize"}),  # its batch's rows: beyond one, GEMMs
            (invariant, "invariant", {"linear"}),  # after the other engine ran, as before it
        ]:
            calls.clear()
            assert greedy(engine) == alone[name]
            assert set(calls) - {"gather_rows"} == kernel_calls, name


@pytest.mark.skipif(native.skinny_linear is None, reason="the skinny kernel is not built")
def test_a_draft_model_and_its_target_keep_their_own_paths(monkeypatch, llama_dir, tmp_path):
    """The faked timing finds the GEMM faster beyond one row on the draft's weights (96 wide)
    and the kernel up to its rows on the target's (64 wide): the draft, tuned first, keeps
    its choice though the target's tuning came after it, and each runs its own."""
    draft_dir = write_hf_model(tmp_path / "draft", seed=3, hidden_size=96, intermediate_size=192)

    def fake_time(path, weights, rows, limit, **setting):
        gemm_wins = rows > 1 and weights[0].shape[1] == 96
        return {GEMM: 0.5 if gemm_wins else 1.0}.get(path, 0.9)

    monkeypatch.setattr(linear_ops, "_time_path", fake_time)
    kernel = native.skinny_linear
    products: list[tuple[int, int]] = []  # (rows, in_features) of each skinny-kernel call

    def recorded(*args):
        products.append((args[4], args[5]))
        return kernel.linear(*args)

    model = AutoModel.from_pretrained(llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    draft = {"speculative": "draft", "draft_model": str(draft_dir)}
    with make_engine(model, tokenizer, **draft) as engine:
        monkeypatch.setattr(native, "skinny_linear", SimpleNamespace(linear=recorded))
        target_plan = engine.scheduler.executor.kernel_plan
        draft_plan = engine.scheduler.speculator.proposer.executor.kernel_plan
        assert target_plan.dense[torch.float32].paths[:7] == (KERNEL,) * 7
        assert draft_plan.dense[torch.float32].paths[:2] == (KERNEL, GEMM)
        engine.generate(PROMPTS[1], max_tokens=12, temperature=0.0, ignore_eos=True)
    # the draft's one-row steps on the kernel, its prompt on the GEMM
    assert {rows for rows, width in products if width == 96} == {1}
    assert any(rows > 1 for rows, width in products if width == 64)  # the target's prompt
