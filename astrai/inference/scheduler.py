"""The scheduling policy, schedule(), and the loop that applies its plans, InferenceScheduler.

One step of the policy:
1. Admit waiting tasks first come, first served while batch slots and KV pages allow; a task
   reuses the pages of its cached prefix, or of the sibling it was sampled with (n > 1). A task
   that needs every prompt position's output (prompt logprobs, a mean embedding) computes its
   whole prompt: cached pages hold K/V only.
2. Every decoding task gets its one token first, oldest first.
3. What is left of the token budget goes to prompt chunks, oldest first, each shrunk to the
   pages to be had without preempting anyone. A chunk never ends inside an image whose tokens
   see each other (Gemma 3's): it stops before the image, or, starting at it, takes the whole
   image even past the budget.
4. When a decode finds no page, or no chunk can run at all, the most recently admitted task is
   preempted: its pages are freed and it goes back to the head of the queue to recompute.
5. With a speculator, decode chunks take guesses from what is left of the budget and the free
   pages (no one is preempted for a guess), so the plan is the whole step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from astrai.config import EngineConfig
from astrai.inference.executor import (
    ExecutorFailedError,
    ModelExecutor,
    SampledToken,
    ScheduledChunk,
)
from astrai.inference.kv_cache import PagedCache
from astrai.inference.speculative import Speculator
from astrai.inference.task import STOP, Task, TaskManager, TaskStatus

log = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """One step's decisions, which InferenceScheduler.step applies to its queue and batch."""

    running: list[Task]  # the batch after this step's admissions and preemptions, oldest first
    chunks: list[ScheduledChunk] = field(default_factory=list)
    admitted: list[Task] = field(default_factory=list)  # to take off the queue, oldest first
    preempted: list[Task] = field(default_factory=list)  # to requeue at the head, newest first


def schedule(
    running: Sequence[Task],
    waiting: Iterable[Task],
    cache: PagedCache,
    config: EngineConfig,
    speculator: Speculator | None = None,
) -> StepPlan:
    """Plan one step by the policy in this module's docstring.

    It changes nothing but the KV pages it reserves or frees, the status and num_computed of
    the tasks it admits or preempts, and the speculator's own state, so a test can drive it
    step by step.
    """
    plan = StepPlan(running=list(running))
    hits: list[tuple[Task, int]] = []  # prefix hits, counted for tasks still admitted at the end
    for task in waiting:
        if len(plan.running) >= config.max_batch_size:
            break
        parent = task.parent
        forks = parent is not None and parent.status is TaskStatus.RUNNING
        if forks and parent.num_computed < len(parent.prompt_ids):
            continue  # wait for the sibling's prompt K/V, then share its pages
        covered = 0
        if forks:
            covered = cache.fork(parent.id, task.id, len(task.prompt_ids))
        elif task.reads_prefix_cache:
            covered = cache.match_prefix(task.id, task.all_ids, task.kv_root)
        if not cache.can_allocate(cache.pages_needed(task.id, task.num_tokens)):
            cache.free(task.id)
            break  # first come, first served: nobody overtakes the head of the queue
        if not forks and task.reads_prefix_cache:
            hits.append((task, covered))
        task.status = TaskStatus.RUNNING
        task.num_computed = covered
        plan.running.append(task)
        plan.admitted.append(task)

    budget = config.max_num_batched_tokens
    for task in list(plan.running):
        if budget == 0:
            break
        if task.status is not TaskStatus.RUNNING or task.num_tokens - task.num_computed != 1:
            continue
        while task.status is TaskStatus.RUNNING and not cache.allocate(task.id, task.num_tokens):
            _preempt_newest(plan, cache)
        if task.status is TaskStatus.RUNNING:
            plan.chunks.append(ScheduledChunk(task, task.num_computed, 1))
            budget -= 1

    for task in plan.running:
        if budget > 0 and task.num_tokens - task.num_computed > 1:
            chunk = _prompt_chunk(task, budget, cache)
            if chunk is not None:
                plan.chunks.append(chunk)
                budget -= chunk.length

    # Prompts part way through hold every page and none can grow: free the newest ones' pages
    # until the oldest can go on.
    while not plan.chunks and plan.running:
        _preempt_newest(plan, cache)
        chunk = _prompt_chunk(plan.running[0], budget, cache) if plan.running else None
        if chunk is not None:
            plan.chunks.append(chunk)
    for task, covered in hits:
        if task in plan.admitted:
            cache.count_hit(task.num_tokens, covered)
    if speculator is not None and plan.chunks:
        unused = config.max_num_batched_tokens - sum(chunk.length for chunk in plan.chunks)
        speculator.extend(plan.chunks, unused, cache)
    return plan


def _prompt_chunk(task: Task, budget: int, cache: PagedCache) -> ScheduledChunk | None:
    """The task's next prompt chunk: at most budget tokens, shrunk to the pages to be had
    without preempting anyone, its end moved off any image whose tokens see each other; None
    when not one page is free, or the image it must start with does not fit."""
    free_slots = cache.capacity(task.id) - task.num_computed
    end = task.num_computed + min(task.num_tokens - task.num_computed, budget, free_slots)
    for image in task.images:
        if image.bidirectional and image.start < end < image.end:
            end = image.start if image.start > task.num_computed else image.end
    length = end - task.num_computed
    if length <= 0 or length > free_slots:
        return None
    allocated = cache.allocate(task.id, task.num_computed + length)
    assert allocated, "a chunk sized to the free pages must fit"
    return ScheduledChunk(task, task.num_computed, length)


def _preempt_newest(plan: StepPlan, cache: PagedCache) -> None:
    """Free the most recently admitted task's pages and send it back to the queue."""
    task = plan.running.pop()
    cache.free(task.id)
    task.num_computed = 0
    task.status = TaskStatus.WAITING
    if task in plan.admitted:
        plan.admitted.remove(task)  # admitted this step, never ran: it keeps its queue place
    else:
        plan.preempted.append(task)


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0


class InferenceScheduler:
    """Owns all scheduling state; runs in one background thread.

    Each step plans with schedule(), applies the plan, runs the executor and post-processes.
    `running` is in admission order, so the last task is the most recently admitted one.
    """

    def __init__(
        self,
        executor: ModelExecutor,
        cache: PagedCache,
        manager: TaskManager,
        config: EngineConfig,
        speculator: Speculator | None = None,
    ) -> None:
        self.executor = executor
        self.cache = cache
        self.manager = manager
        self.config = config
        self.speculator = speculator
        self.running: list[Task] = []
        self.requeued: set[Task] = set()  # preempted tasks waiting to be readmitted
        self.stats = SchedulerStats()
        self.invariant_error: Exception | None = None

    def run_forever(self, stopped: threading.Event) -> None:
        while not stopped.is_set():
            self.manager.wakeup.clear()
            if self.step():
                continue
            if not self.running and not self.manager.num_waiting:
                self._check_idle()
            self.manager.wakeup.wait()
        self.abort_all("the engine shut down")

    def step(self) -> bool:
        """Run one iteration; returns False when there was nothing to run."""
        self._cleanup()
        started = time.perf_counter()  # a step's time includes its guessing
        plan = schedule(
            self.running, self.manager.waiting(), self.cache, self.config, self.speculator
        )
        self._apply(plan)
        if not plan.chunks:
            return False
        ran, sampled = self._execute(plan.chunks)
        if self.speculator is not None:
            self.speculator.timed(plan.chunks, started)
        self._post_process(ran, sampled)
        return True

    def _execute(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[list[ScheduledChunk], list[SampledToken]]:
        """Run the chunks as one step: the chunks that ran and their sampled tokens.

        A failing step must not take the loop, or the requests sharing the step, down: it is
        run again one chunk at a time, so only the requests that fail alone end, with an error.
        Rerunning is safe because nothing is committed before post-processing: a chunk writes
        the same K/V to the same slots again.
        """
        try:
            return chunks, self.executor.execute(chunks)
        except ExecutorFailedError:
            raise
        except Exception as exc:
            if len(chunks) > 1:
                log.warning(
                    "a step of %d requests failed (%s); running each alone", len(chunks), exc
                )
            else:
                log.exception("model step failed for task %d", chunks[0].task.id)
                self._end(chunks[0].task, TaskStatus.FAILED, "error", f"model step failed: {exc}")
                return [], []
        ran: list[ScheduledChunk] = []
        sampled: list[SampledToken] = []
        for chunk in chunks:
            chunk_ran, chunk_sampled = self._execute([chunk])
            ran += chunk_ran
            sampled += chunk_sampled
        return ran, sampled

    def _cleanup(self) -> None:
        aborts = self.manager.take_aborts()
        if not aborts:
            return
        for task in self.running + self.manager.waiting():
            if task.id in aborts:
                self._end(task, TaskStatus.ABORTED, "abort")

    def _apply(self, plan: StepPlan) -> None:
        """Move the plan's admitted and preempted tasks between the queue and the batch.

        Usage counts a prompt once: a readmitted task keeps the prompt tokens and the cached
        tokens of its first admission, when its num_computed is what the cache covered.
        """
        self.running = plan.running
        for task in plan.admitted:
            self.manager.remove_waiting(task)
            if task in self.requeued:
                self.requeued.remove(task)
            else:
                task.cached_tokens = task.num_computed
                self.stats.prompt_tokens += len(task.prompt_ids)
        for task in plan.preempted:
            self.manager.requeue_front(task)
            self.requeued.add(task)
        self.stats.preemptions += len(plan.preempted)

    def _post_process(self, chunks: list[ScheduledChunk], sampled: list[SampledToken]) -> None:
        page_size = self.cache.page_size
        for chunk in chunks:
            task = chunk.task
            # A speculative chunk's K/V holds for its decode row and the draft tokens kept.
            task.num_computed = chunk.start + chunk.length - len(chunk.draft) + chunk.accepted
            if task.num_computed // page_size > chunk.start // page_size:
                tokens = task.all_ids + chunk.draft[: chunk.accepted]
                self.cache.commit(task.id, tokens, task.num_computed)
            if chunk.prompt_logprobs is not None:
                task.add_prompt_logprobs(chunk.start, chunk.prompt_logprobs)
            if chunk.pooled is not None:
                task.add_pooled(chunk.start, chunk.pooled)
            if task.prompt_only and chunk.reaches_end:
                task.end_prompt()
                self._release(task)
        for item in sampled:
            task = item.task
            if task.is_finished:  # a draft token before this one ended it
                continue
            try:
                delta = task.append_token(item.token_id, item.logprob)
            except Exception as exc:  # one request's bad token must not end the others
                log.exception("post-processing task %d failed", task.id)
                self._end(task, TaskStatus.FAILED, "error", f"processing its token failed: {exc}")
                continue
            self.stats.generation_tokens += 1
            self._notify(task, delta)
            if task.is_finished:
                self._release(task)
        for chunk in chunks:
            if chunk.draft:
                self.speculator.verified(chunk)
                if not chunk.task.is_finished:
                    self.cache.truncate(chunk.task.id, chunk.task.num_tokens)

    def _end(self, task: Task, status: TaskStatus, reason: str, error: str | None = None) -> None:
        if task.is_finished:
            return
        if task.status is TaskStatus.WAITING:
            self.manager.remove_waiting(task)
        task.end(status, reason, error)
        self._release(task)

    def _release(self, task: Task) -> None:
        if task in self.running:
            self.running.remove(task)
        self.requeued.discard(task)
        self.cache.free(task.id)
        if self.speculator is not None:
            self.speculator.forget(task)
        self._notify(task, STOP)

    def _notify(self, task: Task, event) -> None:
        try:
            task.callback(task, event)
        except Exception:  # a consumer's bug must not stop the loop for everyone else
            log.exception("callback of task %d failed", task.id)

    def abort_all(self, reason: str) -> None:
        for task in self.running + self.manager.waiting():
            self._end(task, TaskStatus.ABORTED, "abort", reason)

    def _check_idle(self) -> None:
        """The cheap page-accounting self-check, run whenever the engine goes idle."""
        try:
            owned = self.cache.stats().owned
            if owned:
                raise RuntimeError(f"the engine is idle but {owned} KV pages are still owned")
            self.cache.check_invariants()
        except Exception as exc:
            log.error("KV cache accounting is broken: %s", exc)
            if self.config.check_invariants:
                self.invariant_error = exc
