"""The scheduling loop: clean up, admit, plan a step against the token budget, run it."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from astrai.config import EngineConfig
from astrai.inference.executor import ModelExecutor, SampledToken, ScheduledChunk
from astrai.inference.kv_cache import PagedCache
from astrai.inference.task import STOP, Task, TaskManager, TaskStatus

log = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0


class InferenceScheduler:
    """Owns all scheduling state; runs in one background thread.

    `running` is in admission order, so the last task is the most recently admitted one and
    the first to be preempted when the KV pool runs out.
    """

    def __init__(
        self,
        executor: ModelExecutor,
        cache: PagedCache,
        manager: TaskManager,
        config: EngineConfig,
    ) -> None:
        self.executor = executor
        self.cache = cache
        self.manager = manager
        self.config = config
        self.running: list[Task] = []
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
        self._admit()
        chunks = self._plan()
        if not chunks:
            return False
        try:
            sampled = self.executor.execute(chunks)
        except Exception as exc:  # a failing step must not take the loop (and other requests) down
            log.exception("model step failed")
            for chunk in chunks:
                self._end(chunk.task, TaskStatus.FAILED, "error", f"model step failed: {exc}")
            return True
        self._post_process(chunks, sampled)
        return True

    def _cleanup(self) -> None:
        aborts = self.manager.take_aborts()
        if not aborts:
            return
        for task in self.running + self.manager.waiting():
            if task.id in aborts:
                self._end(task, TaskStatus.ABORTED, "abort")

    def _admit(self) -> None:
        if len(self.running) >= self.config.max_batch_size:
            return
        for task in self.manager.waiting():
            if len(self.running) >= self.config.max_batch_size:
                return
            parent = task.parent
            if parent is not None and parent.status is TaskStatus.RUNNING:
                if parent.num_computed < len(parent.prompt_ids):
                    continue  # wait for the sibling's prompt K/V, then share its pages
                covered = self.cache.fork(parent.id, task.id, len(task.prompt_ids))
            else:
                covered = self.cache.match_prefix(task.id, task.all_ids)
            if not self.cache.can_allocate(self.cache.pages_needed(task.id, task.num_tokens)):
                self.cache.free(task.id)
                return  # first come, first served: nobody overtakes the head of the queue
            self.manager.remove_waiting(task)
            if not task.output_ids:
                task.cached_tokens = covered
                self.stats.prompt_tokens += len(task.prompt_ids)
            task.num_computed = covered
            task.status = TaskStatus.RUNNING
            self.running.append(task)

    def _plan(self) -> list[ScheduledChunk]:
        """Decodes first (one token each), then prompt chunks with what is left of the budget."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for task in list(self.running):
            if task.status is not TaskStatus.RUNNING or task.num_tokens - task.num_computed != 1:
                continue
            if self._reserve(task, task.num_tokens):
                chunks.append(ScheduledChunk(task, task.num_computed, 1))
                budget -= 1
        for task in list(self.running):
            remaining = task.num_tokens - task.num_computed
            if task.status is not TaskStatus.RUNNING or remaining <= 1 or budget <= 0:
                continue
            length = self._fit_chunk(task, min(remaining, budget))
            if length:
                chunks.append(ScheduledChunk(task, task.num_computed, length))
                budget -= length
        if not chunks and self.running:
            self._preempt(self.running[-1])
            return self._plan()
        return chunks

    def _reserve(self, task: Task, num_tokens: int) -> bool:
        """Make room for a decode, preempting the newest tasks; False if `task` itself went."""
        while not self.cache.allocate(task.id, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is task:
                return False
        return True

    def _fit_chunk(self, task: Task, length: int) -> int:
        """Shrink a prompt chunk to the pages that can be had without preempting anyone."""
        length = min(length, self.cache.capacity(task.id) - task.num_computed)
        if length <= 0:
            return 0
        allocated = self.cache.allocate(task.id, task.num_computed + length)
        assert allocated, "a chunk sized to the free pages must fit"
        return length

    def _preempt(self, task: Task) -> None:
        """Free a task's pages and requeue it at the head; it recomputes when readmitted."""
        self.running.remove(task)
        self.cache.free(task.id)
        task.num_computed = 0
        task.status = TaskStatus.WAITING
        self.manager.requeue_front(task)
        self.stats.preemptions += 1

    def _post_process(self, chunks: list[ScheduledChunk], sampled: list[SampledToken]) -> None:
        page_size = self.cache.page_size
        for chunk in chunks:
            task = chunk.task
            task.num_computed = chunk.start + chunk.length
            if task.num_computed // page_size > chunk.start // page_size:
                self.cache.commit(task.id, task.all_ids, task.num_computed)
        for item in sampled:
            task = item.task
            delta = task.append_token(item.token_id, item.logprob)
            self.stats.generation_tokens += 1
            self._notify(task, delta)
            if task.is_finished:
                self._release(task)

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
        self.cache.free(task.id)
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
