"""Speculative decoding: output equal to decoding without it, exact sampling, exact pages."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch
from tiny_models import make_engine, real_gguf, run_ids, write_hf_model

from astrai.config import ConfigError, EngineConfig
from astrai.inference import STOP, GenerationParams, GenerationRequest
from astrai.inference.constraints import Constraint
from astrai.inference.kv_cache import PagedCache
from astrai.inference.speculative import Speculator, StepTimes, ngram_draft
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

DRAFTS = ["ngram", "draft-same", "draft-other"]


@pytest.fixture
def always_guess(monkeypatch):
    """Every decode gets all the guesses its proposer has: on a random-weight model whose
    guesses mostly miss the policy would stop guessing, and these tests check the guessing."""
    monkeypatch.setattr(Speculator, "_choose", lambda self, decodes, lengths, rows: list(lengths))


@pytest.fixture(scope="module")
def speculation(llama_dir, tmp_path_factory):
    """Engine settings per proposer: n-grams; the target itself as draft (every guess kept);
    another random model as draft (most guesses rejected, so pages are rolled back)."""
    other = write_hf_model(tmp_path_factory.mktemp("draft"), seed=7)
    return {
        "ngram": {"speculative": "ngram"},
        "draft-same": {"speculative": "draft", "draft_model": str(llama_dir)},
        "draft-other": {"speculative": "draft", "draft_model": str(other)},
    }


def workload(seed=0, n=12, vocab=512):
    """Prompts of mixed lengths that repeat a phrase, so n-grams match."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        phrase = [rng.randrange(4, vocab) for _ in range(rng.randint(2, 6))]
        tail = [rng.randrange(4, vocab) for _ in range(rng.choice([1, 20, 90, 200]))]
        prompts.append(phrase * (1 + i % 4) + tail + phrase)
    return prompts, [rng.randint(8, 40) for _ in prompts]


def outputs(model, tokenizer, prompts, params, **config):
    with make_engine(model, tokenizer, **config) as engine:
        results = run_ids(engine, prompts, params)
        stats = engine.get_stats()
    assert stats.pages_owned == 0
    return [[r.token_ids for r in group] for group in results], stats


@pytest.mark.parametrize("proposer", DRAFTS)
@pytest.mark.parametrize(
    "config",
    [{}, {"max_num_batched_tokens": 64, "max_batch_size": 5}, {"kv_cache_memory": "preempt"}],
    ids=["batch", "chunked-prefill", "preemption"],
)
def test_greedy_output_equals_decoding_without_speculation(
    model, tokenizer, speculation, proposer, config, always_guess
):
    prompts, max_tokens = workload()
    params = [GenerationParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    if config.get("kv_cache_memory") == "preempt":
        # 40 pages of 16 tokens: the prompts cannot all run at once.
        c = model.config
        config = {"kv_cache_memory": 40 * 16 * c.n_layers * 2 * c.n_kv_heads * c.head_dim * 4}
    expected, _ = outputs(model, tokenizer, prompts, params, **config)
    got, stats = outputs(model, tokenizer, prompts, params, **config, **speculation[proposer])
    assert got == expected
    assert stats.speculative_steps > 0
    if proposer == "draft-same":
        assert stats.accepted_tokens == stats.proposed_tokens
    elif proposer == "draft-other":  # two random models: rejections roll pages back
        assert stats.accepted_tokens < stats.proposed_tokens
    else:
        assert 0 < stats.accepted_tokens < stats.proposed_tokens
    if "kv_cache_memory" in config:
        assert stats.preemptions > 0


def run_with_logprobs(engine, prompts, params):
    """Each prompt's (token ids, logprobs as (token, logprob, alternatives)) from its deltas."""
    seen = {}

    def collect(task, event):
        if event is not STOP:
            seen.setdefault(task.id, []).extend(event.logprobs)

    groups = [engine.submit(ids, p, collect) for ids, p in zip(prompts, params, strict=True)]
    tasks = [task for group in groups for task in group]
    while not all(task.is_finished for task in tasks):
        time.sleep(0.01)
    return [
        (
            task.output_ids,
            [(lp.token_id, lp.logprob, [t for t, _ in lp.top]) for lp in seen[task.id]],
        )
        for task in tasks
    ]


def test_seeded_sampling_is_unchanged_by_speculation(model, tokenizer, speculation, always_guess):
    prompts, max_tokens = workload(seed=1)
    params = [
        GenerationParams(max_tokens=m, temperature=0.8, top_p=0.9, seed=i, logprobs=2)
        for i, m in enumerate(max_tokens)
    ]
    with make_engine(model, tokenizer) as engine:
        expected = run_with_logprobs(engine, prompts, params)
    with make_engine(model, tokenizer, **speculation["draft-same"]) as engine:
        got = run_with_logprobs(engine, prompts, params)
        assert engine.get_stats().accepted_tokens > 0
    for (want_ids, want), (have_ids, have) in zip(expected, got, strict=True):
        assert have_ids == want_ids
        assert [(t, top) for t, _, top in have] == [(t, top) for t, _, top in want]
        assert [lp for _, lp, _ in have] == pytest.approx([lp for _, lp, _ in want], abs=1e-4)


def test_rejection_sampling_keeps_the_target_distribution(model, tokenizer, always_guess):
    """The joint law of three sampled tokens over a two-token alphabet, speculating with
    n-gram guesses, against the target's probabilities: a chi-square test."""
    prompt = [40, 41] * 6
    allowed = (40, 41)
    temperature = 4.0
    samples = 1600
    params = GenerationParams(
        max_tokens=3, temperature=temperature, allowed_token_ids=allowed, n=100
    )
    with make_engine(
        model, tokenizer, speculative="ngram", max_batch_size=128, max_waiting=samples
    ) as engine:
        groups = run_ids(engine, [prompt] * (samples // 100), [params] * (samples // 100))
        stats = engine.get_stats()
    assert stats.proposed_tokens > 0 and 0 < stats.accepted_tokens < stats.proposed_tokens
    counts = {}
    for result in itertools.chain.from_iterable(groups):
        key = tuple(result.token_ids)
        counts[key] = counts.get(key, 0) + 1

    def probs(prefix):
        with torch.no_grad():
            logits = model.forward_dense(torch.tensor([prompt + list(prefix)]))[0, -1]
        return (logits[list(allowed)] / temperature).softmax(-1).tolist()

    chi_square = 0.0
    for first, p1 in zip(allowed, probs(()), strict=True):
        for second, p2 in zip(allowed, probs((first,)), strict=True):
            for third, p3 in zip(allowed, probs((first, second)), strict=True):
                expected = samples * p1 * p2 * p3
                chi_square += (counts.get((first, second, third), 0) - expected) ** 2 / expected
    assert chi_square < 24.32  # the 99.9th percentile of chi-square with 7 degrees of freedom


def test_stop_strings_streams_and_grammar_hold(model, tokenizer, speculation, always_guess):
    """Stop strings, streamed pieces and a JSON schema see the kept guesses one at a time."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [
        GenerationParams(max_tokens=30, temperature=0.0, stop=("e",)),
        GenerationParams(max_tokens=30, temperature=0.0, constraint=Constraint.json_schema(schema)),
    ]
    prompts = ["the cat and the cat and the", '{"a": 1} {"a": 1} {"a":']
    results, streams = {}, {}
    for name in ("off", "draft-same", "ngram"):
        config = {} if name == "off" else speculation[name]
        with make_engine(model, tokenizer, **config) as engine:
            results[name] = [engine.generate_results(prompts, params) for params in cases]
            streams[name] = [
                [
                    "".join(p for i, p in engine.generate(prompts, params, stream=True) if i == k)
                    for k in range(len(prompts))
                ]
                for params in cases
            ]
            if name != "off":
                assert engine.get_stats().accepted_tokens > 0
    assert any(r.stop_reason == "e" for r in results["off"][0])
    for name in ("draft-same", "ngram"):
        for want_group, have_group in zip(results["off"], results[name], strict=True):
            assert [r.token_ids for r in have_group] == [r.token_ids for r in want_group]
        texts = [[r.text for r in group] for group in results[name]]
        assert streams[name] == texts


def test_rejected_guesses_return_their_pages():
    cache = PagedCache(1, 1, 2, n_pages=8, page_size=4)
    assert cache.allocate(0, 5)
    cache.commit(0, list(range(5)), 4)
    assert cache.allocate(0, 13)  # a decode row and 8 guesses: 4 pages
    cache.truncate(0, 6)  # 1 guess kept and the target's own token: 2 pages
    assert len(cache.tasks.pages(0)) == 2
    assert cache.stats().free == 6
    cache.check_invariants()
    with pytest.raises(ValueError, match="committed"):
        cache.truncate(0, 3)


def test_ngram_draft_follows_the_latest_longest_match():
    ids = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_draft(ids, 2, max_ngram=3, min_ngram=1) == [7, 8]  # "2 3" last seen before 7
    assert ngram_draft(ids + [4], 2, max_ngram=3, min_ngram=1) == []
    assert ngram_draft([5, 6, 5, 6], 3, max_ngram=2, min_ngram=1) == [5, 6]
    assert ngram_draft([1], 3, max_ngram=2, min_ngram=1) == []
    # a repeating run: the latest "1 2" has two tokens after it, the one before it four
    assert ngram_draft([1, 2, 1, 2, 1, 2], 4, max_ngram=2, min_ngram=1) == [1, 2, 1, 2]


def test_policy_takes_the_guesses_that_pay_at_the_measured_step_times():
    times = StepTimes()
    for rows, seconds in ((1, 0.5), (1, 0.010), (9, 0.5), (9, 0.030)):  # the first: recording
        times.record(rows, seconds)
    assert times.estimate(5) == pytest.approx(0.020)
    assert times.estimate(20) == pytest.approx(0.030 + 11 * 0.0025)  # along the last line
    assert times.estimate(0) == pytest.approx(0.010)  # flat below the smallest
    assert StepTimes().estimate(3) is None
    speculator = Speculator(proposer=None, num_tokens=8)
    speculator.times = times
    tasks = [type("Task", (), {"id": i})() for i in range(2)]
    chunks = [type("Chunk", (), {"task": task})() for task in tasks]
    # Each row costs 2.5 ms on 10: guess j is worth its row while 0.9**j beats the tokens per
    # second so far, which the 6th guess (0.53 of a token) still does and the 7th does not.
    speculator.counts[0] = [0.9, 1.0]
    assert speculator._choose(chunks[:1], [8], rows=1) == [6]
    speculator.counts[0] = [0.1, 1.0]  # a guess worth 0.1 tokens for a quarter more time: none
    assert speculator._choose(chunks[:1], [8], rows=1) == [0]
    # With two decodes the likely guesses of one come before the unlikely of the other.
    speculator.counts[0], speculator.counts[1] = [0.9, 1.0], [0.6, 1.0]
    assert speculator._choose(chunks, [8, 8], rows=2) == [5, 1]
    assert Speculator(proposer=None, num_tokens=8)._choose(chunks, [3, 2], rows=2) == [3, 2]
    # Measured times out of order (3 rows dearer than 4 and 5): sure guesses take all four,
    # though the second alone would not have raised the tokens per second.
    uneven = StepTimes()
    for rows, seconds in ((1, 6.1), (2, 7.8), (3, 11.7), (4, 12.8), (5, 11.4)):
        uneven.record(rows, 1.0)  # the recording step, left out
        uneven.record(rows, seconds / 1000)
    speculator.times, speculator.counts[0] = uneven, [1.0, 1.0]
    assert speculator._choose(chunks[:1], [4], rows=1) == [4]


def test_a_tasks_rate_counts_only_the_guesses_its_checks_judged():
    """Guesses after a check's first miss are never judged: a task whose checks keep all
    four guesses or miss the first has kept 4 of every 5 judged, not the half that
    kept / proposed would say, and the policy takes guesses on that rate."""
    speculator = Speculator(proposer=None, num_tokens=4)
    task = type("Task", (), {"id": 0, "is_finished": False})()
    for accepted in [4, 0] * 40:
        chunk = type("Chunk", (), {"task": task, "draft": [1] * 4, "accepted": accepted})()
        speculator.verified(chunk)
    assert speculator.rate(0) == pytest.approx(0.8, abs=0.1)
    assert speculator.stats.acceptance_rate == pytest.approx(0.5)  # what /metrics reports


def test_speculative_settings_are_checked():
    with pytest.raises(ConfigError, match="draft_model"):
        EngineConfig(speculative="draft")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)


EDIT_REQUEST = """Rename `items` to `entries` in this code and return all of it:

def count_items(items):
    counts = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


def top_items(items, n):
    counts = count_items(items)
    ranked = sorted(counts.items(), key=lambda pair: pair[1], reverse=True)
    return [item for item, _ in ranked[:n]]
"""


def test_real_model_greedy_output_is_unchanged(monkeypatch, always_guess):
    """The real SmolLM2 on its quantized kernels, editing code (most guesses kept): each
    checked row must compute what a plain decode row computes, to the last bit, or a near
    tie somewhere in 160 tokens turns the other way."""
    monkeypatch.setenv("ASTRAI_LINEAR_PATH", "kernel")  # the same linear path at any row count
    gguf = real_gguf()
    model = AutoModel.from_pretrained(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf)
    request = GenerationRequest(messages=({"role": "user", "content": EDIT_REQUEST},))
    params = GenerationParams(max_tokens=160, temperature=0.0)
    with make_engine(model, tokenizer) as engine:
        expected = engine.generate_results(request, params)
    with make_engine(model, tokenizer, speculative="ngram") as engine:
        got = engine.generate_results(request, params)
        stats = engine.get_stats()
    assert got.token_ids == expected.token_ids
    assert stats.accepted_tokens > 32


def test_the_draft_models_pool_takes_the_kv_cache_dtype(model, tokenizer, speculation):
    prompts, max_tokens = workload(n=4)
    params = [GenerationParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    expected, _ = outputs(model, tokenizer, prompts, params, kv_cache_dtype="bf16")
    config = {**speculation["draft-same"], "kv_cache_dtype": "bf16"}
    with make_engine(model, tokenizer, **config) as engine:
        assert engine.scheduler.speculator.proposer.cache.kv.k_cache.dtype == torch.bfloat16
        got = [[r.token_ids for r in group] for group in run_ids(engine, prompts, params)]
    assert got == expected


@pytest.mark.parametrize("proposer", ["ngram", "draft-other"])
def test_guessed_rows_decode_alike_on_either_attention_path(
    model, tokenizer, speculation, proposer, decode_attention, always_guess
):
    prompts, max_tokens = workload(seed=2, n=6)
    params = [GenerationParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    expected, _ = outputs(model, tokenizer, prompts, params)
    got, stats = outputs(model, tokenizer, prompts, params, **speculation[proposer])
    assert got == expected
    assert stats.proposed_tokens > stats.accepted_tokens
