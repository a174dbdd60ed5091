"""End-to-end engine behaviour on a tiny random-weight llama, against transformers."""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import random
from dataclasses import replace

import pytest
import torch
from tiny_models import hf_greedy, make_engine, run_ids, tokens_logprobs_cached

from astrai.inference import STOP, GenerationParams, GenerationRequest
from astrai.inference import scheduler as scheduler_module
from astrai.inference.constraints import Constraint
from astrai.inference.executor import DecodeLayout
from astrai.inference.task import PromptTooLongError, RequestError
from astrai.kernels import native
from astrai.model import AutoModel


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()


def kv_bytes(model):
    """Bytes of K and V per token across all layers, in fp32."""
    c = model.config
    return c.n_layers * 2 * c.n_kv_heads * c.head_dim * 4


def mixed_workload(seed=0, n=16, vocab=512):
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 33, 64, 100, 150, 200, 250, 300] + [
        rng.randint(1, 300) for _ in range(n - 12)
    ]
    prompts = [[rng.randrange(4, vocab) for _ in range(length)] for length in lengths]
    max_tokens = [rng.randint(1, 24) for _ in prompts]
    return prompts, max_tokens


def record_plans(monkeypatch):
    """Record every step an engine plans from now on: the batch before it (each task with its
    tokens left to compute and its output length at the time) and the StepPlan."""
    plans = []
    plan_step = scheduler_module.schedule

    def recording(running, waiting, cache, config, speculator=None):
        before = [(t, t.num_tokens - t.num_computed, len(t.output_ids)) for t in running]
        plan = plan_step(running, waiting, cache, config, speculator)
        plans.append((before, replace(plan, running=list(plan.running))))  # the loop edits it
        return plan

    monkeypatch.setattr(scheduler_module, "schedule", recording)
    return plans


@pytest.fixture(scope="module")
def reference(hf_model, tokenizer):
    prompts, max_tokens = mixed_workload()
    expected = [
        hf_greedy(hf_model, p, m, tokenizer.stop_token_ids)
        for p, m in zip(prompts, max_tokens, strict=True)
    ]
    return prompts, max_tokens, expected


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"enable_prefix_cache": False},
        {"max_num_batched_tokens": 48},
        {"page_size": 4, "max_batch_size": 5},
    ],
    ids=["default", "no-prefix-cache", "chunked-prefill", "small-pages"],
)
def test_greedy_batch_equals_transformers(model, tokenizer, reference, config, monkeypatch):
    prompts, max_tokens, expected = reference
    params = [GenerationParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    plans = record_plans(monkeypatch)
    with make_engine(model, tokenizer, **config) as engine:
        results = run_ids(engine, prompts, params)
        assert engine.get_stats().pages_owned == 0
        budget = engine.config.max_num_batched_tokens
    for result, want in zip(results, expected, strict=True):
        assert result[0].token_ids == want
        stopped = bool(want) and want[-1] in tokenizer.stop_token_ids
        assert result[0].finish_reason == ("stop" if stopped else "length")
    # The outputs held under these scheduling rules: the budget bounds every step, and every
    # decode still in the batch runs before prompt chunks get what is left.
    for before, plan in plans:
        assert sum(chunk.length for chunk in plan.chunks) <= budget
        scheduled = {chunk.task for chunk in plan.chunks}
        assert all(t in scheduled for t, left, _ in before if left == 1 and t in plan.running)
    if budget < 300:
        chunks = [c for _, p in plans for c in p.chunks if len(c.task.prompt_ids) == 300 > c.start]
        assert len(chunks) >= -(-300 // budget)  # the 300-token prompt, in budget-sized pieces


@pytest.mark.skipif(native.paged_attention is None, reason="the C attention kernel was not built")
def test_decode_steps_advance_the_last_steps_layout_in_place(
    model, tokenizer, reference, monkeypatch
):
    """While the same tasks decode, a step moves the last one's layout on (positions, context
    lengths, a table's new page, the tokens) instead of laying it out again; tasks that come
    and go, and pages of 4 tokens that fill every fourth step, keep transformers' tokens."""
    advanced = []
    advance = DecodeLayout.advance

    def counted(layout, chunks, pages):
        batch = advance(layout, chunks, pages)
        advanced.append(batch is not None)
        return batch

    monkeypatch.setattr(DecodeLayout, "advance", counted)
    prompts, max_tokens, expected = reference
    params = [GenerationParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    with make_engine(model, tokenizer, page_size=4, max_batch_size=5) as engine:
        results = run_ids(engine, prompts, params)
    assert [result[0].token_ids for result in results] == expected
    assert sum(advanced) > len(advanced) // 2 > 0, advanced


def test_greedy_batch_equals_transformers_on_pytorch_ops_alone(
    model, tokenizer, reference, monkeypatch
):
    """The path of an install without a C compiler: SDPA decode attention, F.linear and the
    PyTorch formulas of the small ops."""
    monkeypatch.setattr(native, "paged_attention", None)
    monkeypatch.setattr(native, "skinny_linear", None)
    monkeypatch.setattr(native, "fused_ops", None)
    prompts, max_tokens, expected = reference
    params = [GenerationParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    with make_engine(model, tokenizer, max_num_batched_tokens=48) as engine:
        results = run_ids(engine, prompts, params)
    assert [result[0].token_ids for result in results] == expected


def test_preemption_keeps_greedy_outputs(model, tokenizer, reference):
    prompts, max_tokens, expected = reference
    params = [GenerationParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    # 40 pages of 16 tokens: the 300-token prompts alone need 20; running many at once preempts.
    with make_engine(model, tokenizer, kv_cache_memory=40 * 16 * kv_bytes(model)) as engine:
        assert engine.cache.n_pages == 40
        results = run_ids(engine, prompts, params)
        stats = engine.get_stats()
    assert stats.preemptions > 0
    assert stats.pages_owned == 0
    assert [r[0].token_ids for r in results] == expected


def test_preemption_mid_generation_recomputes_outputs(model, tokenizer, monkeypatch):
    """The newest tasks are the victims, and those that already generated tokens resume with
    the same tokens, seeded or greedy."""
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 512) for _ in range(60)] for _ in range(4)]
    params = [
        GenerationParams(max_tokens=40, temperature=0.8 * (i % 2), seed=i, ignore_eos=True)
        for i in range(4)
    ]
    with make_engine(model, tokenizer) as engine:
        expected = run_ids(engine, prompts, params)
    # 16 pages of 16 tokens: the four fit while prefilling, not while each grows to 100 tokens
    plans = record_plans(monkeypatch)
    with make_engine(model, tokenizer, kv_cache_memory=16 * 16 * kv_bytes(model)) as engine:
        results = run_ids(engine, prompts, params)
    for before, plan in plans:
        # the victims are the batch's newest tasks, in admission order, newest first
        batch = [task for task, _, _ in before] + plan.admitted
        assert batch == plan.running + plan.preempted[::-1]
    outputs = {task: n for before, _ in plans for task, _, n in before}
    victims = [outputs[task] for _, plan in plans for task in plan.preempted]
    assert any(n > 0 for n in victims)
    assert [r[0].token_ids for r in results] == [r[0].token_ids for r in expected]
    assert [r[0].text for r in results] == [r[0].text for r in expected]


def test_shared_prefixes_hit_the_cache_and_keep_outputs(model, tokenizer, hf_model):
    rng = random.Random(1)
    system = [rng.randrange(4, 512) for _ in range(100)]
    prompts = [
        system + [rng.randrange(4, 512) for _ in range(rng.randint(1, 40))] for _ in range(8)
    ]
    # same tokens on page 2 after a different page 1: must not share page 2's K/V
    prompts.append(prompts[0][:16] + [7] * 16 + prompts[0][32:64])
    prompts.append(prompts[1][:16][::-1] + prompts[0][16:64])
    expected = [hf_greedy(hf_model, p, 8, tokenizer.stop_token_ids) for p in prompts]
    params = GenerationParams(max_tokens=8, temperature=0.0)
    with make_engine(model, tokenizer) as engine:
        first = run_ids(engine, prompts[:1], [params])
        rest = run_ids(engine, prompts[1:], [params] * (len(prompts) - 1))
        stats = engine.get_stats()
    assert [r[0].token_ids for r in first + rest] == expected
    assert stats.prefix_hit_rate > 0.3
    assert all(r[0].cached_tokens >= 96 for r in rest[:7])
    # page 0 matches; page 1 differs, so page 2 (the same tokens as prompt 0's) is not reused
    assert rest[7][0].cached_tokens == 16
    assert rest[8][0].cached_tokens == 0


@pytest.mark.parametrize("constrained", [False, True], ids=["plain", "json-schema"])
def test_greedy_does_not_depend_on_what_the_prefix_cache_holds(
    model, tokenizer, decode_attention, constrained, monkeypatch
):
    """16 prompts continue token for token, and logprob for logprob bit for bit, with a cold
    cache and after another request cached their first 1, 2 or 3 pages: a prompt's tokens after
    a hit are computed in a shorter chunk than without one, the last of them sometimes alone.
    Holds where the C kernel attends every row (SDPA's rounding depends on a chunk's rows) and
    the linears take one path at every row count (here the skinny kernel, forced: the timing
    may give a dense fp32 linear a GEMM at some row counts; quantized linears keep their kernel
    by default, tests/model/test_gguf.py)."""
    if decode_attention != "c-kernel" or native.skinny_linear is None:
        pytest.skip("only the C kernels compute a row alike in any chunk")
    monkeypatch.setenv("ASTRAI_LINEAR_PATH", "kernel")
    rng = random.Random(3)
    # prompts of 4 pages at most: their prefill too fits the skinny kernel's rows
    prompts = [[rng.randrange(4, 512) for _ in range(rng.randint(49, 64))] for _ in range(16)]
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    params = GenerationParams(
        max_tokens=16,
        temperature=0.0,
        logprobs=0,
        ignore_eos=not constrained,
        constraint=Constraint.json_schema(json.dumps(schema)) if constrained else None,
    )
    with make_engine(model, tokenizer, enable_prefix_cache=False) as engine:
        cold = [tokens_logprobs_cached(engine, prompt, params) for prompt in prompts]
    assert all(cached == 0 for _, _, cached in cold)
    for pages in (1, 2, 3):
        with make_engine(model, tokenizer) as engine:
            for prompt, (tokens, logprobs, _) in zip(prompts, cold, strict=True):
                other = prompt[: 16 * pages] + [3] * 5
                run_ids(engine, [other], [GenerationParams(max_tokens=1, temperature=0.0)])
                warm = tokens_logprobs_cached(engine, prompt, params)
                assert warm == (tokens, logprobs, 16 * pages)


def test_cached_pages_are_reclaimed_when_memory_is_needed(model, tokenizer):
    rng = random.Random(2)
    params = GenerationParams(max_tokens=4, temperature=0.0)
    with make_engine(model, tokenizer, kv_cache_memory=24 * 16 * kv_bytes(model)) as engine:
        prompts = [[rng.randrange(4, 512) for _ in range(200)] for _ in range(6)]
        for prompt in prompts:
            [[result]] = run_ids(engine, [prompt], [params])
            assert result.completion_tokens >= 1
        # the newest prompt's pages are still cached; the oldest were evicted to make room
        [[last]] = run_ids(engine, [prompts[-1]], [params])
        [[first]] = run_ids(engine, [prompts[0]], [params])
        stats = engine.get_stats()
    assert last.cached_tokens == 192
    assert first.cached_tokens == 0
    assert stats.pages_owned == 0


def test_request_that_cannot_fit_is_refused_while_others_complete(model, tokenizer):
    with make_engine(model, tokenizer, max_seq_len=256) as engine:
        ok = engine.generate(["hello world"] * 3, max_tokens=5, temperature=0.0)
        with pytest.raises(PromptTooLongError, match="256"):
            engine.generate("hello " * 200, max_tokens=10)
        with pytest.raises(PromptTooLongError, match="max_tokens|asked"):
            engine.generate("hello", max_tokens=500)
        with pytest.raises(RequestError, match="empty"):
            engine.submit([], GenerationParams(), lambda *a: None)
        assert engine.generate(["hello world"] * 3, max_tokens=5, temperature=0.0) == ok
        assert engine.get_stats().pages_owned == 0


def test_n_samples_share_prompt_pages(model, tokenizer):
    prompt = list(range(10, 110))
    with make_engine(model, tokenizer, enable_prefix_cache=False) as engine:
        [group] = run_ids(engine, [prompt], [GenerationParams(max_tokens=6, n=4, seed=3)])
        stats = engine.get_stats()
    assert len(group) == 4
    assert [r.cached_tokens for r in group] == [0, 96, 96, 96]
    assert stats.pages_owned == 0
    assert len({tuple(r.token_ids) for r in group}) > 1
    # the shared pages hold the right K/V: greedy samples all equal the n=1 greedy output
    with make_engine(model, tokenizer, enable_prefix_cache=False) as engine:
        [[single]] = run_ids(engine, [prompt], [GenerationParams(max_tokens=6, temperature=0.0)])
        [greedy] = run_ids(engine, [prompt], [GenerationParams(max_tokens=6, n=4, temperature=0.0)])
    assert [r.cached_tokens for r in greedy] == [0, 96, 96, 96]
    assert [r.token_ids for r in greedy] == [single.token_ids] * 4


def test_seeded_sampling_is_batch_invariant(model, tokenizer):
    seeded = GenerationParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    other = GenerationParams(max_tokens=20, temperature=0.8)
    prompt = list(range(20, 60))
    with make_engine(model, tokenizer) as engine:
        [[alone]] = run_ids(engine, [prompt], [seeded])
        batch = run_ids(
            engine,
            [list(range(5, 30)), prompt, list(range(100, 190))],
            [other, seeded, other],
        )
        greedy = run_ids(engine, [prompt], [GenerationParams(max_tokens=12, temperature=0.0)])
        top1 = run_ids(engine, [prompt], [GenerationParams(max_tokens=12, top_k=1, seed=9)])
    assert batch[1][0].token_ids == alone.token_ids
    assert alone.token_ids != greedy[0][0].token_ids  # it really sampled
    assert top1[0][0].token_ids == greedy[0][0].token_ids


def test_stream_concatenates_to_text(model, tokenizer):
    with make_engine(model, tokenizer) as engine:
        text = engine.generate("The quick brown fox", max_tokens=30, temperature=0.0)
        pieces = list(
            engine.generate("The quick brown fox", max_tokens=30, temperature=0.0, stream=True)
        )
        prompts = ["Hello", "你好世界", "Emoji 😀"]
        texts = engine.generate(prompts, max_tokens=20, temperature=0.0)
        streamed = {i: "" for i in range(3)}
        for i, piece in engine.generate(prompts, max_tokens=20, temperature=0.0, stream=True):
            streamed[i] += piece
    assert "".join(pieces) == text
    assert [streamed[i] for i in range(3)] == texts


def test_abandoned_stream_aborts_and_frees_pages(model, tokenizer):
    with make_engine(model, tokenizer) as engine:
        stream = engine.generate("Hello there", max_tokens=200, ignore_eos=True, stream=True)
        next(stream)
        assert engine.get_stats().running == 1
        stream.close()
        engine.generate("Hello", max_tokens=2, ignore_eos=True)
        stats = engine.get_stats()
    assert stats.pages_owned == 0
    assert stats.generation_tokens < 100  # aborted long before its 200 tokens


def test_stop_strings_cut_the_output(model, tokenizer):
    with make_engine(model, tokenizer) as engine:
        params = GenerationParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        [[full]] = run_ids(engine, [tokenizer.encode("Once upon")], [params])
        text = full.text
        assert len(text) > 12
        # a stop string that spans tokens: pick text across a token boundary
        pieces = [tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
        boundary = next(len(p) for p in pieces if len(p) >= 6)
        stop = text[boundary - 3 : boundary + 3]
        cut = text[: text.find(stop)]
        [[result]] = run_ids(
            engine,
            [tokenizer.encode("Once upon")],
            [replace(params, stop=(stop,))],
        )
        streamed = "".join(engine.generate("Once upon", replace(params, stop=(stop,)), stream=True))
    assert result.text == cut
    assert result.finish_reason == "stop" and result.stop_reason == stop
    assert streamed == cut


def test_concurrent_async_consumers_complete(model, tokenizer):
    async def consume(engine, i):
        return "".join(
            [p async for p in engine.generate_async(f"prompt {i}", max_tokens=8, temperature=0.0)]
        )

    async def main(engine):
        return await asyncio.gather(*(consume(engine, i) for i in range(32)))

    with make_engine(model, tokenizer) as engine:
        outputs = asyncio.run(main(engine))
        expected = engine.generate(
            [f"prompt {i}" for i in range(32)], max_tokens=8, temperature=0.0
        )
        assert engine.get_stats().pages_owned == 0
    assert outputs == expected


def test_cancelled_async_consumer_frees_pages(model, tokenizer):
    async def main(engine):
        streaming = asyncio.Event()

        async def consume():
            async for _ in engine.generate_async("Hello", max_tokens=500, ignore_eos=True):
                streaming.set()

        task = asyncio.create_task(consume())
        await streaming.wait()  # cancelled mid-stream, with hundreds of tokens to go
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with make_engine(model, tokenizer, max_seq_len=1024) as engine:
        asyncio.run(main(engine))
        engine.generate("Hello", max_tokens=2)
        assert engine.get_stats().pages_owned == 0


def test_chat_request_uses_template(model, tokenizer):
    request = GenerationRequest(
        messages=({"role": "user", "content": "hi"},),
        params=GenerationParams(max_tokens=5, temperature=0.0),
    )
    with make_engine(model, tokenizer) as engine:
        chat = engine.generate(request)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        [[direct]] = run_ids(engine, [ids], [request.params])
    assert chat == direct.text
    with pytest.raises(RequestError, match="role"):
        GenerationRequest(messages=({"role": "wizard", "content": "x"},))
    with pytest.raises(RequestError, match="at least one"):
        GenerationRequest(messages=())


def test_engine_errors_are_exported_where_the_engine_is():
    """Users catch what the engine raises by importing it from astrai.inference."""
    import astrai.inference
    from astrai.inference import task

    for name in (
        "RequestError",
        "InvalidParamsError",
        "PromptTooLongError",
        "QueueFullError",
        "EngineClosedError",
        "GenerationError",
        "RequestAbortedError",
    ):
        assert getattr(astrai.inference, name) is getattr(task, name)
        assert name in astrai.inference.__all__


def test_submit_all_queues_every_task_or_none(model, tokenizer):
    import time

    from astrai.inference import QueueFullError

    refused = []
    with make_engine(model, tokenizer, max_batch_size=1, max_waiting=3) as engine:
        params = GenerationParams(max_tokens=engine.max_request_tokens - 3, ignore_eos=True)
        # the one batch slot is busy and one task waits, so new tasks would stay queued
        [running] = engine.submit([5, 6, 7], params, lambda task, event: None)
        while engine.get_stats().running == 0:
            time.sleep(0.01)
        [waiting] = engine.submit([8, 9], params, lambda task, event: None)
        for prompts, n, error, message in [
            ([[10, 11], [12] * engine.max_seq_len], 1, PromptTooLongError, "shorten"),
            ([[10, 11], []], 1, RequestError, "empty"),
            ([[10, 11], [12, 13], [14]], 1, QueueFullError, "full"),
            ([[10, 11], [12, 13]], 2, RequestError, "4 places.*holds 3"),
        ]:
            with pytest.raises(error, match=message):
                engine.submit_all(
                    prompts, replace(params, n=n), lambda task, event: refused.append(event)
                )
            assert engine.get_stats().waiting == 1
        engine.abort(waiting)
        engine.abort(running)
        assert engine.generate(["a", "b"], max_tokens=2) is not None
        assert engine.get_stats().pages_owned == 0
    assert refused == []  # no task of a refused request ever ran or ended


def test_merged_stream_gives_each_choice_its_deltas_then_one_result(model, tokenizer):
    prompts = [tokenizer.encode("Hello"), tokenizer.encode("The quick brown")]
    params = GenerationParams(max_tokens=6, n=2, temperature=0.0, ignore_eos=True)

    async def collect(engine):
        texts, results, after_result, order = ["", "", "", ""], {}, [], []
        async for event in engine.submit_all_async(prompts, params):
            if event.result is None:
                after_result.append(event.index in results)
                texts[event.index] += event.delta.text
                order.append((event.index, "last" if event.delta.last else "delta"))
            else:
                assert event.index not in results
                results[event.index] = event.result
                order.append((event.index, "result"))
        return texts, results, after_result, order

    with make_engine(model, tokenizer) as engine:
        texts, results, after_result, order = asyncio.run(collect(engine))
        expected = engine.generate(["Hello", "The quick brown"], params)
        assert engine.get_stats().pages_owned == 0
    assert sorted(results) == [0, 1, 2, 3]
    assert not any(after_result)
    # Each choice's last delta says so, and its result comes right after it (no other event
    # between), so a stream can send the last text with the finish.
    for i in range(4):
        kinds = [kind for index, kind in order if index == i]
        assert kinds == ["delta"] * 5 + ["last", "result"]
        at = order.index((i, "last"))
        assert order[at + 1] == (i, "result")
    # index i is sample i % n of prompt i // n
    assert texts == [text for group in expected for text in group]
    assert [results[i].text for i in range(4)] == texts


def test_result_status_becomes_the_engines_typed_error(model, tokenizer):
    import threading
    import time

    from astrai.inference import GenerationError, RequestAbortedError, TaskResult

    def result(reason, error=None):
        return TaskResult("", [], reason, None, 1, 0, 0, error)

    result("stop").raise_for_status()
    result("length").raise_for_status()
    with pytest.raises(GenerationError, match="generation failed: model step failed: boom"):
        result("error", "model step failed: boom").raise_for_status()
    with pytest.raises(RequestAbortedError, match="aborted: the engine shut down"):
        result("abort", "the engine shut down").raise_for_status()
    # a request in flight when the engine closes raises instead of returning cut-off text
    with make_engine(model, tokenizer, max_seq_len=1024) as engine:
        outcome = queue.SimpleQueue()

        def generate():
            try:
                outcome.put(engine.generate("Hello", max_tokens=900, ignore_eos=True))
            except Exception as exc:
                outcome.put(exc)

        thread = threading.Thread(target=generate)
        thread.start()
        while engine.get_stats().running == 0:
            time.sleep(0.01)
    thread.join(timeout=60)
    raised = outcome.get(timeout=1)
    assert isinstance(raised, RequestAbortedError), raised
    assert "the engine shut down" in str(raised)


def test_the_kv_pool_holds_what_the_engine_can_use_within_its_budget(model, tokenizer, caplog):
    """max_batch_size x max_seq_len tokens by default, max_total_tokens where given, and the
    budget caps both; the start line says what is reserved, for how many tokens and why."""
    caplog.set_level(logging.INFO, logger="astrai.inference.engine")
    large = {"kv_cache_memory": 1 << 30}
    with make_engine(model, tokenizer, max_batch_size=3, max_seq_len=100, **large) as engine:
        assert engine.cache.n_pages == 3 * 7  # 100 tokens take 7 pages of 16
    assert (
        "reserved, touched only as tokens are written: 336 tokens in 21 pages of 16, for 3 x "
        "max_seq_len 100" in caplog.text
    )

    with make_engine(model, tokenizer, max_total_tokens=50, **large) as engine:
        assert engine.cache.n_pages == 4
        with pytest.raises(PromptTooLongError, match="the KV cache pool"):
            engine.submit([1] * 60, GenerationParams(max_tokens=5), lambda *event: None)
    assert "64 tokens in 4 pages of 16, for max_total_tokens 50" in caplog.text

    budget = 10 * 16 * kv_bytes(model)
    with make_engine(model, tokenizer, max_total_tokens=1000, kv_cache_memory=budget) as engine:
        assert engine.cache.n_pages == 10
    megabytes = 63 * 16 * kv_bytes(model) / 1e6  # 1000 tokens take 63 pages
    assert (
        f"KV cache {budget / 1e6:.1f} MB torch.float32 reserved, touched only as tokens are "
        f"written: 160 tokens in 10 pages of 16, capped by kv_cache_memory, {budget / 1e6:.1f} "
        f"MB (max_total_tokens 1000 would take {megabytes:.0f} MB)" in caplog.text
    )


def held_addresses(engine) -> set[int]:
    """Where the storages lie that the engine's recorded steps hold."""
    return {storage.data_ptr() for storage in engine.scheduler.executor.recorded.held}


@pytest.mark.skipif(native.paged_attention is None, reason="the C attention kernel was not built")
def test_weights_given_new_storage_mid_request_are_read_as_they_were_until_a_new_layout(
    llama_dir, tokenizer
):
    """A decode that continues the last step's does not look at the weights' addresses: a
    weight given new storage between two of its steps (here by the request's own callback) is
    read from its old storage, which the recorded steps hold, and the next request, laid out
    afresh, reads the new weight."""
    prompt = list(range(5, 25))
    params = GenerationParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    model = AutoModel.from_pretrained(llama_dir)
    weight = model.layers[0].feed_forward.w13.weight
    new_values = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))

    def tokens(engine, on_token=lambda: None):
        events = queue.SimpleQueue()

        def callback(task, event):
            on_token()
            events.put(event)

        (task,) = engine.submit(prompt, params, callback)
        while events.get(timeout=120) is not STOP:
            pass
        return task.result().token_ids

    with make_engine(AutoModel.from_pretrained(llama_dir), tokenizer) as engine:
        before = tokens(engine)
    replaced = AutoModel.from_pretrained(llama_dir)
    replaced.layers[0].feed_forward.w13.weight.data = new_values.clone()
    with make_engine(replaced, tokenizer) as engine:
        after = tokens(engine)
    assert after != before

    old = weight.untyped_storage().data_ptr()
    seen, old_held = [], []

    def replace_at_the_fourth_token():
        seen.append(None)
        if len(seen) == 4:
            weight.data = new_values.clone()
        if len(seen) > 4:
            old_held.append(old in held_addresses(engine))

    with make_engine(model, tokenizer) as engine:
        assert tokens(engine, replace_at_the_fourth_token) == before
        assert old_held and all(old_held)
        assert tokens(engine) == after
        assert old not in held_addresses(engine)


@pytest.mark.skipif(native.paged_attention is None, reason="the C attention kernel was not built")
def test_a_decode_recorded_again_mid_request_holds_the_weights_it_reads(llama_dir, tokenizer):
    """A continued decode whose graph is recorded again (rope's tables moved: another engine on
    the model, or growth) looks at the weights first, so the storage it records is held:
    replaced once more before a fresh layout, it is not freed under the graph."""
    model = AutoModel.from_pretrained(llama_dir)
    weight = model.layers[0].feed_forward.w13.weight
    params = GenerationParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    events, seen, recorded_held = queue.SimpleQueue(), [], []

    def on_token(task, event):
        seen.append(None)
        if len(seen) == 3:
            weight.data = torch.randn(weight.shape, generator=torch.Generator().manual_seed(1))
            model.rope.tables = tuple(table.clone() for table in model.rope.tables)
        if len(seen) > 4:
            recorded_held.append(weight.untyped_storage().data_ptr() in held_addresses(engine))
        events.put(event)

    with make_engine(model, tokenizer) as engine:
        engine.submit(list(range(5, 25)), params, on_token)
        while events.get(timeout=120) is not STOP:
            pass
    assert recorded_held and all(recorded_held)
