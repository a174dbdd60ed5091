"""Sampling: greedy and seeded determinism, the filters and penalties as defined, logprobs.

Statistical checks draw thousands of samples in one batched call (one row repeated) from a
small vocabulary, with the RNG seeded, and compare frequencies with the exact distribution.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.inference.sample import (
    NUCLEUS_CANDIDATES,
    MinPStrategy,
    PenaltyStrategy,
    SamplingBatch,
    SamplingPipeline,
    TemperatureStrategy,
    TopKStrategy,
    TopPStrategy,
    argmax_rows,
    sample,
)
from astrai.inference.task import GenerationParams, ThinkingBudget

V = 8
# Distinct, well separated probabilities so no filter boundary is a rounding question.
PROBS = torch.tensor([0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.04, 0.01], dtype=torch.float64)
LOGITS = PROBS.log().float()
N = 20_000
TOLERANCE = 0.015  # about 4.5 standard deviations of a frequency near 0.3 at N draws


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: intra-op threads only add wake-up latency on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(params, prompts=None, outputs=None) -> SamplingBatch:
    prompts = prompts if prompts is not None else [[] for _ in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingBatch.build(params, prompts, outputs, "cpu")


def draw_many(params: GenerationParams, logits: torch.Tensor = LOGITS, seed: int = 0, **history):
    """N samples of one request in one batched call, as frequencies over the vocabulary."""
    torch.manual_seed(seed)
    batch = build([params] * N, **history)
    tokens = sample(logits.expand(N, -1), batch).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).double() / N


def assert_matches(freqs: torch.Tensor, probs: torch.Tensor) -> None:
    assert (freqs - probs).abs().max().item() < TOLERANCE, (freqs, probs)
    assert torch.all(freqs[probs == 0] == 0), "sampled a token the filters removed"


def renormalised(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum()


# Greedy


def test_temperature_zero_takes_argmax_without_sorting(monkeypatch):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    # Filters of greedy rows are moot, so a batch of greedy rows never sorts the vocab.
    params = [GenerationParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.2)] * 6

    def forbidden(*args, **kwargs):
        raise AssertionError("a greedy batch sorted the vocab")

    monkeypatch.setattr(torch.Tensor, "sort", forbidden)
    monkeypatch.setattr(torch.Tensor, "topk", forbidden)
    monkeypatch.setattr(torch, "sort", forbidden)
    monkeypatch.setattr(torch, "topk", forbidden)
    out = sample(logits, build(params))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_rows_in_a_mixed_batch_take_argmax():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    params = [
        GenerationParams(temperature=0.0) if i % 2 else GenerationParams(top_p=0.5, seed=i)
        for i in range(8)
    ]
    tokens = sample(logits, build(params)).token_ids
    assert tokens[1::2] == logits[1::2].argmax(-1).tolist()


def test_vanishing_temperature_is_greedy_and_small_ones_stay_finite():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(8)) * 30
    tiny = build([GenerationParams(temperature=1e-30)] * 4)
    assert sample(logits, tiny).token_ids == logits.argmax(-1).tolist()
    small = build([GenerationParams(temperature=1e-4, top_p=0.9, min_p=0.1)] * 4)
    assert sample(logits, small).token_ids == logits.argmax(-1).tolist()


def test_top_k_one_equals_greedy():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(3))
    prompts = [[i, i + 1, 7] for i in range(16)]
    outputs = [[i * 3 % 300, 5] for i in range(16)]
    penalties = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)
    for extra in ({}, penalties):
        greedy = [GenerationParams(temperature=0.0, **extra)] * 16
        top1 = [GenerationParams(temperature=1.7, top_k=1, top_p=0.9, **extra)] * 16
        expected = sample(logits, build(greedy, prompts, outputs)).token_ids
        assert sample(logits, build(top1, prompts, outputs)).token_ids == expected


@pytest.mark.parametrize(
    "setting",
    [
        {},
        {"top_k": 1, "temperature": 0.7},
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.2},
        {"logit_bias": {3: 5.0}},
        {"allowed_token_ids": (1, 2)},
        {"min_tokens": 4},
        {"thinking_budget": ThinkingBudget(tokens=2, end_ids=(7,))},
        {"logprobs": 2},
    ],
    ids=lambda setting: ",".join(setting) or "plain",
)
def test_a_greedy_batch_built_at_once_is_the_batch_built_field_by_field(monkeypatch, setting):
    """Plain greedy rows take a batch of neutral fields without working each out (a decode
    step's shortcut); whatever a setting changes before the argmax keeps its field."""
    params = [GenerationParams(**{"temperature": 0.0, **setting}), GenerationParams(temperature=0)]
    prompts, outputs = [[1, 2, 3], [4]], [[3, 3], []]
    at_once = build(params, prompts, outputs)
    monkeypatch.setattr(sys.modules[SamplingBatch.__module__], "_raw_argmax", lambda p: False)
    assert settings_of(at_once) == settings_of(build(params, prompts, outputs))


def settings_of(batch: SamplingBatch) -> dict:
    """The batch's fields as plain values, tensors as lists."""

    def plain(value):
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return value

    return plain(batch)


# Seeds


def generate_seeded(logits_row, params, neighbours, position, steps=24):
    """The tokens a seeded request draws over `steps` steps sitting among `neighbours`."""
    tokens = []
    others = len(neighbours)
    for step in range(steps):
        rows = list(neighbours)
        rows.insert(position, params)
        outputs = [[(step * 7 + j) % 64] * (step + j % 3) for j in range(others + 1)]
        outputs[position] = list(tokens)
        other_logits = torch.randn(others + 1, logits_row.shape[0]) * 2
        logits = other_logits.clone()
        logits[position] = logits_row
        out = sample(logits, build(rows, outputs=outputs))
        tokens.append(out.token_ids[position])
    return tokens


def test_seeded_request_gives_the_same_tokens_whatever_the_batch():
    logits_row = torch.randn(64, generator=torch.Generator().manual_seed(4))
    params = GenerationParams(temperature=1.2, top_p=0.95, seed=1234)
    neighbours = [
        GenerationParams(temperature=0.0),
        GenerationParams(temperature=0.7, top_k=5),
        GenerationParams(seed=99, min_p=0.1),
        GenerationParams(repetition_penalty=1.5, frequency_penalty=0.4, logprobs=3),
        GenerationParams(temperature=2.0, top_p=0.3, presence_penalty=1.0),
    ]
    torch.manual_seed(0)
    alone = generate_seeded(logits_row, params, [], 0)
    assert len(set(alone)) > 3, "the draw must change from step to step"
    torch.manual_seed(1)
    assert generate_seeded(logits_row, params, neighbours, 0) == alone
    torch.manual_seed(2)
    assert generate_seeded(logits_row, params, neighbours, 3) == alone
    torch.manual_seed(3)
    assert generate_seeded(logits_row, params, neighbours[::-1], 5) == alone


def test_seeded_draw_depends_on_seed_and_step_only():
    """Recompute after preemption must redraw the same token: (seed, step) fixes the draw."""
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(5))
    params = [GenerationParams(seed=7)]
    first = [sample(logits, build(params, outputs=[[0] * n])).token_ids[0] for n in range(30)]
    torch.manual_seed(12345)
    again = [sample(logits, build(params, outputs=[[n % 5] * n])).token_ids[0] for n in range(30)]
    assert again == first
    other_seed = [GenerationParams(seed=8)]
    other = [sample(logits, build(other_seed, outputs=[[0] * n])).token_ids[0] for n in range(30)]
    assert other != first


def test_extreme_uniforms_never_pick_a_filtered_token():
    """u = 0 and u rounding up to 1 are the edges where inverse-CDF could land on a token of
    zero probability at either end of the vocab."""
    logits = torch.tensor([[float("-inf"), 1.0, 2.0, float("-inf")]] * 2)
    batch = build([GenerationParams(seed=1), GenerationParams(seed=2)])
    batch = dataclasses.replace(batch, seeded_uniforms=torch.tensor([0.0, 1.0]))
    assert sample(logits, batch).token_ids == [1, 2]


def test_unseeded_rows_differ_across_draws():
    logits = torch.zeros(64, 100)
    batch = build([GenerationParams()] * 64)
    first, second = sample(logits, batch).token_ids, sample(logits, batch).token_ids
    assert first != second
    assert len(set(first)) > 20


def test_seeded_draws_follow_the_distribution():
    expected = (LOGITS.double() / 0.8).softmax(-1)
    many_seeds = [GenerationParams(temperature=0.8, seed=s) for s in range(N)]
    tokens = sample(LOGITS.expand(N, -1), build(many_seeds)).token_ids
    assert_matches(torch.bincount(torch.tensor(tokens), minlength=V).double() / N, expected)
    # One seed over N steps: only len(output_ids) matters, so ranges stand in for the ids.
    one_seed = [GenerationParams(temperature=0.8, seed=42)] * N
    tokens = sample(LOGITS.expand(N, -1), build(one_seed, outputs=[range(n) for n in range(N)]))
    freqs = torch.bincount(torch.tensor(tokens.token_ids), minlength=V).double() / N
    assert_matches(freqs, expected)


# The distribution under each setting


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_frequencies_match_softmax_of_logits_over_temperature(temperature):
    freqs = draw_many(GenerationParams(temperature=temperature))
    assert_matches(freqs, (LOGITS.double() / temperature).softmax(-1))


def test_top_k_samples_only_the_k_largest():
    freqs = draw_many(GenerationParams(temperature=1.5, top_k=3))
    probs = (LOGITS.double() / 1.5).softmax(-1)
    assert_matches(freqs, renormalised(probs, torch.arange(V) < 3))


def expected_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest set of most likely tokens whose total probability is >= top_p."""
    order = probs.argsort(descending=True)
    keep = torch.zeros(len(probs), dtype=torch.bool)
    total = 0.0
    for token in order.tolist():
        keep[token] = True
        total += probs[token].item()
        if total >= top_p:
            break
    return keep


@pytest.mark.parametrize("top_p", [0.2, 0.45, 0.75, 0.93])
def test_top_p_keeps_exactly_the_nucleus(top_p):
    keep = expected_nucleus(PROBS, top_p)
    freqs = draw_many(GenerationParams(top_p=top_p))
    assert_matches(freqs, renormalised(PROBS, keep))


def test_top_p_per_row_in_one_batch():
    """Each row keeps its own nucleus, computed on its own probabilities."""
    top_ps = [0.1, 0.45, 0.75, 0.95, 1.0, 0.6]
    temperatures = [1.0, 1.0, 2.0, 0.5, 1.0, 3.0]
    params = [
        GenerationParams(temperature=t, top_p=p) for t, p in zip(temperatures, top_ps, strict=True)
    ]
    logits = LOGITS.expand(len(params), -1)
    processed = SamplingPipeline()(logits, build(params))
    for row, (t, p) in enumerate(zip(temperatures, top_ps, strict=True)):
        probs = (LOGITS.double() / t).softmax(-1)
        assert torch.equal(processed[row].isfinite(), expected_nucleus(probs, p)), row


def test_top_p_keeps_tokens_tied_with_the_last_one_in_the_nucleus():
    """The nucleus is a set of probabilities, not of sort positions, so ties go together."""
    logits = torch.tensor([[0.4, 0.2, 0.2, 0.2, 0.0]]).log()
    processed = TopPStrategy().apply(logits, build([GenerationParams(top_p=0.5)]))
    assert processed[0].isfinite().tolist() == [True, True, True, True, False]


def test_top_p_beyond_the_candidates_sorts_only_those_rows():
    """A nucleus larger than the partial sort's candidates is found by a full sort, and each
    row gets the same nucleus whichever rows share its batch."""
    vocab = 4 * NUCLEUS_CANDIDATES
    steep = torch.linspace(0.0, -40.0, vocab)
    flat = torch.linspace(0.0, -1.0, vocab)
    rows = [(steep, 0.9), (flat, 0.9), (flat, 0.3), (steep, 1.0), (flat.flip(0), 0.6)]
    params = [GenerationParams(top_p=p) for _, p in rows]
    logits = torch.stack([row for row, _ in rows])
    processed = TopPStrategy().apply(logits, build(params))
    for i, (row, top_p) in enumerate(rows):
        keep = expected_nucleus(row.double().softmax(-1), top_p)
        assert torch.equal(processed[i].isfinite(), keep), i
        alone = TopPStrategy().apply(logits[i : i + 1], build(params[i : i + 1]))
        assert torch.equal(alone[0], processed[i]), i
    assert processed[1].isfinite().sum() > NUCLEUS_CANDIDATES


@pytest.mark.parametrize("min_p", [0.05, 0.35, 0.5, 0.9])
def test_min_p_keeps_exactly_the_tokens_over_threshold(min_p):
    keep = PROBS / PROBS.max() >= min_p
    processed = MinPStrategy().apply(LOGITS[None], build([GenerationParams(min_p=min_p)]))
    assert torch.equal(processed[0].isfinite(), keep)
    assert_matches(draw_many(GenerationParams(min_p=min_p)), renormalised(PROBS, keep))


def test_min_p_one_keeps_every_token_tied_with_the_top():
    logits = torch.tensor([[2.0, 0.5, 2.0, -1.0, 2.0]])
    processed = MinPStrategy().apply(logits, build([GenerationParams(min_p=1.0)]))
    assert processed[0].isfinite().tolist() == [True, False, True, False, True]


def test_filters_compose_in_order():
    """top_k, then top_p on the renormalised survivors, then min_p, as the pipeline says."""
    params = GenerationParams(temperature=1.0, top_k=5, top_p=0.7, min_p=0.6)
    top5 = renormalised(PROBS, torch.arange(V) < 5)
    nucleus = expected_nucleus(top5, 0.7)
    after_top_p = renormalised(top5, nucleus)
    keep = nucleus & (after_top_p >= 0.6 * after_top_p.max())
    processed = SamplingPipeline()(LOGITS[None], build([params]))
    assert torch.equal(processed[0].isfinite(), keep)
    assert_matches(draw_many(params), renormalised(PROBS, keep))


# Penalties


def reference_penalties(logits, params, prompt, output):
    """Penalties token by token, straight from their definitions."""
    out = logits.clone().double()
    for token in set(prompt) | set(output):
        if out[token] > 0:
            out[token] /= params.repetition_penalty
        else:
            out[token] *= params.repetition_penalty
    for token in set(output):
        out[token] -= params.frequency_penalty * output.count(token)
        out[token] -= params.presence_penalty
    return out


PENALTY_ROWS = [
    GenerationParams(),
    GenerationParams(repetition_penalty=1.5),
    GenerationParams(repetition_penalty=0.7),
    GenerationParams(presence_penalty=1.2),
    GenerationParams(frequency_penalty=0.5),
    GenerationParams(frequency_penalty=-0.3, presence_penalty=-0.5),
    GenerationParams(repetition_penalty=2.0, presence_penalty=0.4, frequency_penalty=0.3),
    GenerationParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2),
]


def test_penalties_change_the_logits_exactly_as_defined():
    rows = len(PENALTY_ROWS)
    logits = torch.randn(rows, 40, generator=torch.Generator().manual_seed(6)) * 3
    prompts = [[1, 2, 3, 3, 30 + i] for i in range(rows)]
    outputs = [[3, 4, 4, 4, 5, 2, 10 + i, 10 + i] for i in range(rows)]
    processed = PenaltyStrategy().apply(logits, build(PENALTY_ROWS, prompts, outputs))
    for row, params in enumerate(PENALTY_ROWS):
        expected = reference_penalties(logits[row], params, prompts[row], outputs[row])
        torch.testing.assert_close(processed[row].double(), expected, rtol=1e-6, atol=1e-6)


def test_no_penalties_build_no_history():
    batch = build([GenerationParams(temperature=0.5)] * 3, [[1, 2]] * 3, [[3]] * 3)
    assert batch.prompt_and_output is None and batch.output is None
    assert batch.repetition_penalty is None and batch.presence_penalty is None


def test_repetition_penalty_shifts_the_distribution():
    params = GenerationParams(repetition_penalty=1.8)
    # Token 0 in the prompt and 1 in the output: both seen, both positive or negative logits.
    logits = torch.tensor([1.0, -0.5, 0.8, 0.3, 0.0, -1.0, -2.0, 0.5])
    freqs = draw_many(params, logits, prompts=[[0]] * N, outputs=[[1]] * N)
    expected = reference_penalties(logits, params, [0], [1]).softmax(-1)
    assert_matches(freqs, expected)
    assert freqs[0] < logits.softmax(-1)[0].item() - 0.05


@pytest.mark.parametrize(
    "params",
    [GenerationParams(presence_penalty=1.5), GenerationParams(frequency_penalty=0.6)],
)
def test_presence_and_frequency_penalties_shift_the_distribution(params):
    output = [0, 0, 0, 2]
    # The prompt does not count for presence and frequency: token 1 keeps its probability.
    freqs = draw_many(params, prompts=[[1]] * N, outputs=[output] * N)
    expected = reference_penalties(LOGITS, params, [], output).softmax(-1)
    assert_matches(freqs, expected)
    assert freqs[0] < PROBS[0].item() - 0.1


# Logprobs


def test_logprobs_are_of_the_raw_logits_with_sorted_alternatives():
    logits = torch.randn(5, 60, generator=torch.Generator().manual_seed(7)) * 2
    params = [
        GenerationParams(temperature=0.3, top_k=4, logprobs=0),
        GenerationParams(temperature=0.0, repetition_penalty=1.7, logprobs=5),
        GenerationParams(),
        GenerationParams(top_p=0.5, frequency_penalty=1.0, logprobs=20),
        GenerationParams(min_p=0.2, logprobs=1, seed=3),
    ]
    outputs = [[int(logits[i].argmax())] * 3 for i in range(5)]
    before = logits.clone()
    out = sample(logits, build(params, [[0, 1]] * 5, outputs))
    assert torch.equal(logits, before), "sampling must not modify the model's logits"
    raw = logits.log_softmax(-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for row, p in enumerate(params):
        if p.logprobs is None:
            assert out.top_logprobs[row] == []
            continue
        assert out.logprobs[row] == pytest.approx(raw[row, out.token_ids[row]].item(), abs=1e-6)
        top = out.top_logprobs[row]
        assert len(top) == p.logprobs
        assert [value for _, value in top] == sorted((value for _, value in top), reverse=True)
        values, ids = raw[row].topk(p.logprobs)
        assert [token for token, _ in top] == ids.tolist()
        assert [value for _, value in top] == pytest.approx(values.tolist(), abs=1e-6)


def test_logprobs_zero_gives_no_alternatives():
    out = sample(LOGITS[None], build([GenerationParams(logprobs=0)]))
    assert out.top_logprobs is None
    assert out.logprobs == [pytest.approx(LOGITS.log_softmax(-1)[out.token_ids[0]].item())]


# Vectorisation


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(
        st.fixed_dictionaries(
            dict(
                temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
                top_k=st.sampled_from([0, 1, 3, 50]),
                top_p=st.sampled_from([1.0, 0.9, 0.4]),
                min_p=st.sampled_from([0.0, 0.1, 0.5]),
                repetition_penalty=st.sampled_from([1.0, 1.4]),
                presence_penalty=st.sampled_from([0.0, 0.8]),
                frequency_penalty=st.sampled_from([0.0, -0.5]),
                seed=st.one_of(st.none(), st.integers(-(2**40), 2**40)),
            )
        ),
        min_size=1,
        max_size=6,
    ),
    logits_seed=st.integers(0, 1000),
)
def test_each_row_is_processed_as_if_alone(rows, logits_seed):
    """Per-row values in one batch give every row exactly what it would get by itself."""
    params = [GenerationParams(**row) for row in rows]
    logits = torch.randn(len(params), 30, generator=torch.Generator().manual_seed(logits_seed))
    prompts = [[i, 2 * i + 1] for i in range(len(params))]
    outputs = [[3, 3, 20 - i] for i in range(len(params))]
    batch = build(params, prompts, outputs)
    processed = SamplingPipeline()(logits, batch)
    tokens = sample(logits, batch).token_ids
    for row, p in enumerate(params):
        alone = build([p], [prompts[row]], [outputs[row]])
        assert torch.equal(SamplingPipeline()(logits[row : row + 1], alone)[0], processed[row])
        assert processed[row, tokens[row]].isfinite(), "sampled a filtered token"
        if p.temperature == 0.0 or p.top_k == 1 or p.seed is not None:
            assert sample(logits[row : row + 1], alone).token_ids == [tokens[row]]


def test_custom_pipeline_runs_only_its_strategies():
    params = [GenerationParams(temperature=2.0, top_k=4, top_p=0.3)] * N
    processed = SamplingPipeline([TemperatureStrategy()])(LOGITS[None], build(params[:1]))
    torch.testing.assert_close(processed[0], LOGITS / 2.0)
    # Without TopPStrategy the nucleus (2 tokens here) is not applied, top_k's 4 tokens are.
    torch.manual_seed(0)
    pipeline = SamplingPipeline([TopKStrategy()])
    tokens = sample(LOGITS.expand(N, -1), build(params), pipeline).token_ids
    freqs = torch.bincount(torch.tensor(tokens), minlength=V).double() / N
    assert_matches(freqs, renormalised(PROBS, torch.arange(V) < 4))


def test_argmax_rows_picks_as_torch_argmax():
    """The first of equal maxima, a NaN above any number, a row of -inf's first token; large
    rows too (NumPy's vectorised search)."""
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(3))
    logits[0, 17] = logits[0, 40000] = 100.0
    logits[1, 5], logits[1, 9] = float("nan"), float("nan")
    logits[2] = float("-inf")
    logits[3, 48000] = float("inf")
    logits[4, :] = 1.5
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax_rows(logits).tolist()[:5] == [17, 5, 0, 48000, 0]
    assert torch.equal(argmax_rows(logits[0]), logits[0].argmax(dim=-1))  # one row, 0-d
