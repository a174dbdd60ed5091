"""The scheduling policy, one rule per test: schedule() driven step by step on a real PagedCache
and real Tasks, and InferenceScheduler where the rule is how it applies a plan."""

from __future__ import annotations

import random

import pytest
import torch

from astrai.config import EngineConfig
from astrai.inference.executor import ModelExecutor
from astrai.inference.kv_cache import PagedCache
from astrai.inference.scheduler import InferenceScheduler, StepPlan, schedule
from astrai.inference.speculative import NgramProposer, Speculator
from astrai.inference.task import (
    GenerationParams,
    PromptImage,
    Task,
    TaskManager,
    TaskStatus,
)

PAGE = 4


@pytest.fixture
def make_task(tokenizer):
    """A task whose prompt is length tokens from first on, repeating every period; it ignores
    EOS, so it runs to max_tokens."""

    def make(length, max_tokens=8, first=10, parent=None, period=300):
        params = GenerationParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompt = [first + i % period for i in range(length)]
        return Task(
            prompt, params, lambda task, event: None, tokenizer.detokenizer(), parent=parent
        )

    return make


def make_cache(n_pages, enable_prefix_cache=True):
    return PagedCache(
        1, 1, 4, n_pages=n_pages, page_size=PAGE, enable_prefix_cache=enable_prefix_cache
    )


def engine_config(max_batch_size=8, budget=64):
    return EngineConfig(max_batch_size=max_batch_size, max_num_batched_tokens=budget)


def chunks_of(plan: StepPlan) -> list[tuple[Task, int, int]]:
    return [(chunk.task, chunk.start, chunk.length) for chunk in plan.chunks]


def warm(cache: PagedCache, task: Task) -> None:
    """Leave the KV of task's prompt in the prefix cache, as a finished request does."""
    cache.allocate(task.id, len(task.prompt_ids))
    cache.commit(task.id, task.prompt_ids, len(task.prompt_ids))
    cache.free(task.id)


class Loop:
    """What InferenceScheduler.step does around schedule(), with a fixed token for the model's:
    the queue and the batch, each chunk's KV computed, a token sampled at a chunk that reaches
    the end of its task, and finished tasks' pages freed."""

    def __init__(self, cache: PagedCache, config: EngineConfig, tasks=()):
        self.cache, self.config = cache, config
        self.waiting: list[Task] = list(tasks)
        self.running: list[Task] = []
        self.finished: list[Task] = []

    def step(self) -> StepPlan:
        plan = schedule(self.running, self.waiting, self.cache, self.config)
        self.running = list(plan.running)
        self.waiting = plan.preempted[::-1] + [t for t in self.waiting if t not in plan.admitted]
        for chunk in plan.chunks:
            task = chunk.task
            task.num_computed = chunk.start + chunk.length
            self.cache.commit(task.id, task.all_ids, task.num_computed)
            if chunk.samples:
                task.append_token(5, None)
                if task.is_finished:
                    self.running.remove(task)
                    self.cache.free(task.id)
                    self.finished.append(task)
        self.cache.check_invariants()
        return plan


def test_decodes_run_before_older_prompt_chunks(make_task):
    cache = make_cache(16)
    decoding = make_task(5, first=200)
    warm(cache, make_task(5, first=200))
    prompt = make_task(40)
    plan = schedule([], [prompt, decoding], cache, engine_config(budget=8))
    assert decoding.num_computed == 4  # its prefix hit leaves it one token, a decode
    assert chunks_of(plan) == [(decoding, 4, 1), (prompt, 0, 7)]


def test_guesses_are_planned_with_the_step_from_the_budget_prompts_leave(make_task):
    """The plan is the whole step: a decode's guesses are in it, taken from what is left of the
    token budget after prompt chunks, with their pages reserved."""
    cache = make_cache(16)
    decoding = make_task(9, first=200, period=3)
    warm(cache, make_task(9, first=200, period=3))
    plan = schedule([], [decoding], cache, engine_config(budget=8), Speculator(NgramProposer(), 4))
    [chunk] = plan.chunks
    assert chunk.draft and chunk.draft == [200, 201, 202, 200][: len(chunk.draft)]
    assert (chunk.start, chunk.length) == (8, 1 + len(chunk.draft))
    assert len(cache.tasks.pages(decoding.id)) * PAGE >= decoding.num_tokens + len(chunk.draft)

    cache = make_cache(16)
    decoding = make_task(9, first=200, period=3)
    warm(cache, make_task(9, first=200, period=3))
    prompt = make_task(40)
    speculator = Speculator(NgramProposer(), 4)
    plan = schedule([], [decoding, prompt], cache, engine_config(budget=8), speculator)
    assert chunks_of(plan) == [(decoding, 8, 1), (prompt, 0, 7)]  # the prompt took the budget


def test_the_token_budget_is_never_exceeded(make_task):
    cache = make_cache(80)
    for i in range(10):
        warm(cache, make_task(5, first=20 * i))
    decodes = [make_task(5, max_tokens=3, first=20 * i) for i in range(10)]
    plan = schedule([], decodes, cache, engine_config(max_batch_size=10, budget=6))
    # ten prefix hits that leave one token each: more decodes than the budget, the oldest run
    assert chunks_of(plan) == [(task, 4, 1) for task in decodes[:6]]

    rng = random.Random(0)
    tasks = [make_task(rng.randint(1, 30), max_tokens=rng.randint(1, 12)) for _ in range(24)]
    loop = Loop(make_cache(40), engine_config(max_batch_size=10, budget=6), tasks)
    used = []
    while loop.running or loop.waiting:
        used.append(sum(chunk.length for chunk in loop.step().chunks))
    assert max(used) == 6
    assert len(loop.finished) == len(tasks)


def test_a_long_prompt_runs_in_budget_sized_chunks(make_task):
    task = make_task(20)
    loop = Loop(make_cache(16), engine_config(budget=8), [task])
    assert [chunks_of(loop.step()) for _ in range(3)] == [
        [(task, 0, 8)],
        [(task, 8, 8)],
        [(task, 16, 4)],
    ]


@pytest.mark.parametrize("bidirectional", [True, False], ids=["sees itself", "causal"])
def test_a_chunk_never_ends_inside_an_image_that_sees_itself(make_task, bidirectional):
    """A Gemma 3 image's tokens see each other: a chunk stops before such an image, then takes
    it whole, past the budget, or the rest of it after a prefix hit; a causal image is cut
    anywhere."""
    task, warmed = make_task(30), make_task(8)
    image = PromptImage(torch.zeros(3, 2, 2), b"image", 6, 12, bidirectional=bidirectional)
    task.images = [image]
    loop = Loop(make_cache(16), engine_config(budget=8), [task])
    expected = [(0, 6), (6, 12), (18, 8), (26, 4)] if bidirectional else [(0, 8), (8, 8)]
    assert [chunks_of(loop.step()) for _ in expected] == [[(task, *c)] for c in expected]

    again = make_task(30)
    again.images = [image]
    cache = make_cache(16)
    warm(cache, warmed)  # the first 8 tokens: a hit that ends inside the image
    plan = schedule([], [again], cache, engine_config(budget=8))
    assert chunks_of(plan) == [(again, 8, 10 if bidirectional else 8)]


def test_a_chunk_shrinks_to_the_free_pages(make_task):
    older, newer = make_task(12), make_task(12, first=100)
    cache = make_cache(5)
    plan = schedule([], [older, newer], cache, engine_config())
    # Each fit on its own when admitted; the older one's chunk leaves two pages for the newer.
    assert chunks_of(plan) == [(older, 0, 12), (newer, 0, 8)]
    assert cache.stats().free == 0


def test_nobody_overtakes_the_head_of_the_queue(make_task):
    cache = make_cache(8)
    holder = make_task(23)
    Loop(cache, engine_config(), [holder]).step()  # holds 6 of the 8 pages
    head, small = make_task(12, first=100), make_task(3, first=200)
    plan = schedule([holder], [head, small], cache, engine_config())
    assert plan.admitted == [] and plan.running == [holder]
    assert head.status is small.status is TaskStatus.WAITING
    assert cache.stats().owned == 6  # the head's trial match was undone


def test_prefix_hits_reduce_the_work_scheduled(make_task):
    cache = make_cache(16)
    warm(cache, make_task(12, first=50))
    task = make_task(15, first=50)
    plan = schedule([], [task], cache, engine_config())
    assert chunks_of(plan) == [(task, 12, 3)]
    cold = make_task(15, first=50)
    plan = schedule([], [cold], make_cache(16, enable_prefix_cache=False), engine_config())
    assert chunks_of(plan) == [(cold, 0, 15)]


def test_a_sibling_waits_for_its_parents_prompt_then_shares_its_pages(make_task):
    parent = make_task(10, max_tokens=4)
    child = make_task(10, max_tokens=4, parent=parent)
    later = make_task(3, first=200)
    cache = make_cache(16, enable_prefix_cache=False)
    loop = Loop(cache, engine_config(budget=6), [parent, child, later])
    assert loop.step().admitted == [parent, later]  # a waiting sibling alone may be passed
    while parent.num_computed < len(parent.prompt_ids):
        assert child.status is TaskStatus.WAITING
        loop.step()
    plan = loop.step()
    assert plan.admitted == [child]
    assert (child, 8, 2) in chunks_of(plan)  # only the last two prompt tokens are its own
    assert cache.tasks.pages(child.id)[:2] == cache.tasks.pages(parent.id)[:2]


def test_the_newest_task_is_preempted_when_a_decode_finds_no_page(make_task):
    cache = make_cache(5)
    tasks = [make_task(4, max_tokens=20, first=10 * i) for i in range(4)]
    loop = Loop(cache, engine_config(max_batch_size=4), tasks)
    loop.step()  # four one-page prompts, one free page; each now decodes into a second page
    plan = loop.step()
    # the oldest takes the free page; the second frees the newest's; the third is the newest
    assert plan.preempted == [tasks[3], tasks[2]]
    assert plan.running == tasks[:2]
    assert chunks_of(plan) == [(tasks[0], 4, 1), (tasks[1], 4, 1)]
    assert all(t.status is TaskStatus.WAITING and t.num_computed == 0 for t in tasks[2:])
    assert cache.tasks.pages(tasks[2].id) == cache.tasks.pages(tasks[3].id) == []


def test_when_no_chunk_can_run_the_newest_task_makes_room(make_task):
    """Two prompts part way through, each waiting for a page the other holds: without a
    preemption the engine would stall for good."""
    cache = make_cache(4)
    warm(cache, make_task(8, first=50))  # 2 of the 4 pages stay cached
    older = make_task(12)
    loop = Loop(cache, engine_config(budget=4), [older])
    loop.step()
    newer = make_task(12, first=50)  # its prefix hit takes the cached pages the older counted on
    loop.waiting.append(newer)
    assert chunks_of(loop.step()) == [(older, 4, 4)]  # the last free page; the budget is spent
    assert cache.stats().owned == 4 and newer.num_computed == 8
    plan = loop.step()
    assert plan.preempted == [newer]
    assert chunks_of(plan) == [(older, 8, 4)]


def test_max_batch_size_caps_the_batch(make_task):
    tasks = [make_task(4, max_tokens=2, first=10 * i) for i in range(3)]
    loop = Loop(make_cache(16), engine_config(max_batch_size=2), tasks)
    assert loop.step().admitted == tasks[:2]
    assert loop.step().admitted == []
    assert loop.step().admitted == tasks[2:]  # the first two finished with their 2 tokens


def test_no_task_starves_under_a_stream_of_arrivals(make_task):
    """The big head of the queue is not overtaken forever by small newcomers that fit, and
    every preempted task runs again."""
    # lifetimes of 3 to 11 steps, so the small ones never all end at once
    small = [make_task(4, max_tokens=2 + i * 7 % 9, first=i % 200) for i in range(100)]
    big = make_task(44, max_tokens=4, first=300)  # 12 pages in the end: the whole pool
    loop = Loop(make_cache(12), engine_config(max_batch_size=6, budget=16), small[:6])
    preempted = set(loop.step().preempted)
    loop.waiting.append(big)  # the pool is busy when it arrives
    for newcomer in small[6:]:  # one arrives every step
        loop.waiting.append(newcomer)
        preempted.update(loop.step().preempted)
    assert big.is_finished, "the big request never ran"
    for _ in range(200):
        preempted.update(loop.step().preempted)
    assert preempted and all(task.is_finished for task in preempted)
    assert len(loop.finished) == len(small) + 1


def test_a_prefix_hit_counts_once_when_its_task_is_admitted(make_task):
    cache = make_cache(8)
    warm(cache, make_task(8, first=50))
    holder = make_task(23)
    Loop(cache, engine_config(), [holder]).step()  # 6 of 8 pages; 2 cached pages of the prefix
    task = make_task(15, first=50)
    for _ in range(3):  # 3 attempts: covering 8 tokens, it still needs 2 more pages than there are
        assert schedule([holder], [task], cache, engine_config()).admitted == []
    assert (cache.stats().hit_tokens, cache.stats().lookup_tokens) == (0, 23)  # the holder's
    cache.free(holder.id)
    assert schedule([], [task], cache, engine_config()).admitted == [task]
    assert (cache.stats().hit_tokens, cache.stats().lookup_tokens) == (8, 23 + 15)


def test_a_hit_undone_in_its_step_is_not_counted(make_task):
    """A task admitted on a prefix hit and preempted in the same step (the decodes needed its
    pages) stays queued, and its hit is not counted: it never ran."""
    cache = make_cache(4)
    warm(cache, make_task(4, first=50))  # 1 page cached
    decoding = [make_task(4, max_tokens=20, first=10 * i) for i in range(2)]
    loop = Loop(cache, engine_config(), decoding)
    loop.step()  # 2 full pages, 1 free: the next decodes need 2
    lookups = cache.stats().lookup_tokens
    hit = make_task(8, first=50)  # a 4-token hit and 1 page more: the free one
    loop.waiting.append(hit)
    plan = loop.step()
    assert plan.admitted == [] and plan.preempted == [] and loop.waiting == [hit]
    assert chunks_of(plan) == [(decoding[0], 4, 1), (decoding[1], 4, 1)]
    assert (cache.stats().hit_tokens, cache.stats().lookup_tokens) == (0, lookups)


def real_scheduler(model, n_pages, **config) -> InferenceScheduler:
    c = model.config
    cache = PagedCache(c.n_layers, c.n_kv_heads, c.head_dim, n_pages=n_pages, page_size=PAGE)
    config = EngineConfig(**config)
    executor = ModelExecutor(model, cache.kv, cache.tasks.pages)
    return InferenceScheduler(executor, cache, TaskManager(100), config)


def test_victims_are_requeued_at_the_head_oldest_first(model, make_task):
    scheduler = real_scheduler(model, 5, max_batch_size=4)
    tasks = [make_task(4, max_tokens=20, first=10 * i) for i in range(5)]
    scheduler.manager.add_tasks(tasks)
    scheduler.step()
    scheduler.step()  # as in the test above: tasks 3 and 2 are preempted
    assert scheduler.manager.waiting() == [tasks[2], tasks[3], tasks[4]]
    assert scheduler.stats.preemptions == 2


def test_a_task_preempted_before_its_first_token_keeps_its_first_admissions_usage(model, make_task):
    scheduler = real_scheduler(model, 6, max_num_batched_tokens=4)
    short, long = make_task(3, max_tokens=8), make_task(17, max_tokens=2, first=100)
    scheduler.manager.add_tasks([short, long])
    while not scheduler.stats.preemptions:
        scheduler.step()  # the long prompt's chunks fill the pool until the short one's decode
    assert long.status is TaskStatus.WAITING and not long.output_ids
    while scheduler.step():
        pass
    assert long.result().completion_tokens == 2
    assert long.result().cached_tokens == 0  # the pages it wrote itself are no prefix hit
    assert scheduler.stats.prompt_tokens == 3 + 17
    assert scheduler.stats.preemptions == 1
