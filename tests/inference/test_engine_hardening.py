"""One request never fails the others: extreme sampling settings, a failing step, closing."""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time

import pytest
import torch
from tiny_models import make_engine

from astrai.config import ConfigError
from astrai.inference import (
    STOP,
    EngineClosedError,
    GenerationParams,
    RequestAbortedError,
    SamplingPipeline,
)
from astrai.inference.sample import BaseSamplingStrategy, SamplingBatch, sample

# In the documented ranges, yet a tiny top_p rounds to 0 in float32 and a tiny repetition
# penalty divides a positive logit to inf.
HOSTILE = [
    {"top_p": 1e-50},
    {"top_p": 5e-324},  # the least subnormal double
    {"repetition_penalty": 1e-40},
]
HEALTHY = 6
TIMEOUT = 60


def run_together(engine, tokenizer, params: list[GenerationParams], before_start=None):
    """Submit one request per params so that all of them join the same first step; return
    their results. The loop is held inside a blocker's callback while they are submitted;
    before_start(tasks) runs there too."""
    submitted = threading.Event()
    events: queue.SimpleQueue = queue.SimpleQueue()

    def hold(task, event):
        if event is not STOP:
            submitted.wait(TIMEOUT)

    prompt = tokenizer.encode("The quick brown fox")
    engine.submit(prompt, GenerationParams(max_tokens=1), hold)
    tasks = [
        task
        for p in params
        for task in engine.submit(prompt, p, lambda task, event: events.put(event))
    ]
    if before_start is not None:
        before_start(tasks)
    submitted.set()
    for _ in tasks:
        while events.get(timeout=TIMEOUT) is not STOP:
            pass
    return [task.result() for task in tasks]


def sampled(**settings) -> GenerationParams:
    return GenerationParams(max_tokens=6, ignore_eos=True, temperature=1.0, **settings)


@pytest.mark.parametrize("hostile", HOSTILE, ids=lambda h: f"{h}")
def test_extreme_settings_sample_beside_healthy_requests(model, tokenizer, hostile):
    with make_engine(model, tokenizer) as engine:
        results = run_together(engine, tokenizer, [sampled()] * HEALTHY + [sampled(**hostile)])
    assert [(r.finish_reason, r.error) for r in results] == [("length", None)] * (HEALTHY + 1)
    assert all(0 <= t < model.config.vocab_size for r in results for t in r.token_ids)


def test_tiny_top_p_keeps_the_most_likely_token():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    for top_p in (1e-50, 5e-324, 1e-9):
        batch = SamplingBatch.build([sampled(top_p=top_p)], [[]], [[]], "cpu")
        assert sample(logits, batch).token_ids == [1]


def test_tiny_repetition_penalty_draws_among_the_seen_tokens():
    logits = torch.tensor([[5.0, 3.0, -1.0, 2.0, 4.0]]).expand(200, -1)
    params = [sampled(repetition_penalty=1e-40)] * 200
    batch = SamplingBatch.build(params, [[1, 2, 3]] * 200, [[]] * 200, "cpu")
    # Seen tokens 1 and 3 are pushed to the same huge logit; token 2 is negative, so shrunk.
    assert set(sample(logits, batch).token_ids) == {1, 3}


class ExplodeOnMarker(BaseSamplingStrategy):
    """Fails the whole step whenever a row with top_k == MARKER is in it."""

    MARKER = 13

    def apply(self, logits, batch):
        if batch.top_k is not None and bool((batch.top_k == self.MARKER).any()):
            raise RuntimeError("sampler exploded")
        return logits


def test_a_failing_step_ends_only_the_request_that_fails_alone(model, tokenizer):
    with make_engine(model, tokenizer) as engine:
        executor = engine.scheduler.executor
        executor.pipeline = SamplingPipeline([*executor.pipeline.strategies, ExplodeOnMarker()])
        params = [sampled()] * 3 + [sampled(top_k=ExplodeOnMarker.MARKER)] + [sampled()] * 3
        results = run_together(engine, tokenizer, params)
    reasons = [r.finish_reason for r in results]
    assert reasons == ["length"] * 3 + ["error"] + ["length"] * 3
    assert "sampler exploded" in results[3].error


class ExplodingDetokenizer:
    def add(self, token_id: int) -> str:
        raise ValueError("cannot decode")


def test_a_failing_post_process_ends_only_its_request(model, tokenizer):
    def break_one(tasks):
        tasks[2]._detokenizer = ExplodingDetokenizer()

    with make_engine(model, tokenizer) as engine:
        results = run_together(engine, tokenizer, [sampled()] * 5, before_start=break_one)
    assert [r.finish_reason for r in results] == ["length"] * 2 + ["error"] + ["length"] * 2
    assert "cannot decode" in results[2].error


def test_a_stream_cut_by_close_raises(model, tokenizer):
    engine = make_engine(model, tokenizer, max_seq_len=1024)
    pieces = engine.generate("Hello", max_tokens=900, ignore_eos=True, stream=True)
    next(pieces)
    engine.close()
    with pytest.raises(RequestAbortedError, match="the engine shut down"):
        for _ in pieces:
            pass


def test_an_async_stream_cut_by_close_raises(model, tokenizer):
    engine = make_engine(model, tokenizer, max_seq_len=1024)

    async def consume():
        pieces = engine.generate_async("Hello", max_tokens=900, ignore_eos=True)
        await anext(pieces)
        await asyncio.to_thread(engine.close)
        with pytest.raises(RequestAbortedError, match="the engine shut down"):
            async for _ in pieces:
                pass

    asyncio.run(asyncio.wait_for(consume(), TIMEOUT))


def outcome_in_thread(fn) -> queue.SimpleQueue:
    """Run fn on a daemon thread (a hang must not hold the test run); its return value or
    exception arrives on the queue."""
    outcome: queue.SimpleQueue = queue.SimpleQueue()

    def run():
        try:
            outcome.put(fn())
        except Exception as exc:
            outcome.put(exc)

    threading.Thread(target=run, daemon=True).start()
    return outcome


def test_a_submit_between_its_check_and_close_raises_instead_of_hanging(model, tokenizer):
    engine = make_engine(model, tokenizer)
    add_tasks = engine.manager.add_tasks
    checked, closed = threading.Event(), threading.Event()

    def add_after_close(tasks):
        checked.set()
        closed.wait(TIMEOUT)
        add_tasks(tasks)

    engine.manager.add_tasks = add_after_close
    outcome = outcome_in_thread(lambda: engine.generate("Hello", max_tokens=4))
    assert checked.wait(TIMEOUT)
    engine.close()
    closed.set()
    assert isinstance(outcome.get(timeout=TIMEOUT), EngineClosedError)


def test_streams_racing_close_always_end(model, tokenizer):
    """Close lands before the submit, mid-stream or after the end; each stream must end."""
    rng = random.Random(0)
    for _ in range(30):
        engine = make_engine(model, tokenizer)
        start = threading.Barrier(2)
        delay = rng.uniform(0, 0.002)
        stream_delay, close_delay = rng.choice([(delay, 0.0), (0.0, delay)])

        def stream(engine=engine, start=start, delay=stream_delay):
            start.wait(TIMEOUT)
            time.sleep(delay)
            return "".join(engine.generate("Hello", max_tokens=32, stream=True))

        outcome = outcome_in_thread(stream)
        start.wait(TIMEOUT)
        time.sleep(close_delay)
        engine.close()
        ended = outcome.get(timeout=TIMEOUT)  # a hang fails here
        assert isinstance(ended, str | RequestAbortedError | EngineClosedError), ended


def test_turning_cuda_graphs_off_is_refused_off_cuda(model, tokenizer):
    """--no-cuda-graphs on a CPU model would be accepted and do nothing: refused instead."""
    with pytest.raises(ConfigError, match="applies to CUDA"):
        make_engine(model, tokenizer, cuda_graphs=False)


def test_asking_for_cuda_graphs_is_refused_off_cuda(model, tokenizer):
    """--cuda-graphs likewise: the default (None) takes graphs where there is CUDA."""
    with pytest.raises(ConfigError, match=r"cuda_graphs=True \(--cuda-graphs\) applies to CUDA"):
        make_engine(model, tokenizer, cuda_graphs=True)
