"""Speculative decoding: guess a decoding task's next tokens, check them all in one pass.

Batch-1 decode reads every weight once per token; a decode row followed by k guessed tokens
reads them once for up to k + 1 tokens. The target model scores the guesses in the step's
forward pass, each a decode row of its own (the same attention kernel and sums as plain
decoding), and the executor samples every row exactly as plain decoding would sample that
position (the same processed distribution, the same seeded uniform): a guess is
kept while it equals the token drawn there, and the first token that differs is the target's
own next token. With deterministic guesses this is rejection sampling (accept guess d with
probability p(d), else draw from p without d), so the output distribution is exactly the
target's; and a greedy or seeded request gets the very tokens it gets without speculation.

Rejected guesses leave K/V in slots past the task's computed tokens; the next step overwrites
them, and the pages that held only rejected tokens go back to the pool (PagedCache.truncate),
never to the prefix cache.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from astrai.inference.constraints import ConstraintState
from astrai.inference.executor import ModelExecutor, ScheduledChunk
from astrai.inference.kv_cache import PagedCache
from astrai.inference.sample import argmax_rows
from astrai.inference.step_batch import StepBatch
from astrai.inference.task import Task


def ngram_draft(ids: Sequence[int], num_tokens: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
    last n tokens, for the largest n in [min_ngram, max_ngram] that occurs; [] if none does.
    The latest occurrence with num_tokens after it wins over a later one cut short by the end
    of the sequence (in a repeating run the latest is a few tokens back, and offered only
    those)."""
    tokens = np.asarray(ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n :]
        # Occurrences starting at i < length - n, so the suffix does not match itself.
        starts = np.flatnonzero(tokens[: length - n] == suffix[0])
        for offset in range(1, n):
            starts = starts[tokens[starts + offset] == suffix[offset]]
        if starts.size:
            whole = starts[starts + n + num_tokens <= length]
            follow = (whole[-1] if whole.size else starts[-1]) + n
            return tokens[follow : follow + num_tokens].tolist()
    return []


class NgramProposer:
    """Guesses from the sequence itself: what followed its last n tokens the last time they
    appeared (code edits, answers quoting a document, JSON that repeats its keys)."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, tasks: Sequence[Task], lengths: Sequence[int]) -> list[list[int]]:
        return [
            ngram_draft(task.all_ids, n, self.max_ngram, self.min_ngram) if n else []
            for task, n in zip(tasks, lengths, strict=True)
        ]

    def forget(self, task: Task) -> None:
        """Nothing to drop: the proposer keeps no state per task."""


class DraftModelProposer:
    """Guesses from a smaller model with the target's tokenizer, greedily, on its own KV cache.

    The draft's cache keeps the K/V of the task's real tokens only: guesses it fed are
    forgotten after each proposal and fed again next time if the target kept them (the same
    forward pass that feeds the newest token), so nothing rejected can linger in it.
    """

    def __init__(self, executor: ModelExecutor, cache: PagedCache) -> None:
        self.executor = executor
        self.cache = cache  # the draft's own pages
        self.computed: dict[int, int] = {}  # task id -> real tokens in the draft's cache

    def propose(self, tasks: Sequence[Task], lengths: Sequence[int]) -> list[list[int]]:
        cache = self.cache
        drafts: list[list[int]] = [[] for _ in tasks]
        # The draft feeds all its guesses but the last, so it needs a slot for each of those.
        active = [
            i
            for i, (task, n) in enumerate(zip(tasks, lengths, strict=True))
            if n and cache.allocate(task.id, task.num_tokens + n - 1)
        ]
        fed = {i: min(self.computed.get(tasks[i].id, 0), tasks[i].num_tokens - 1) for i in active}
        for i in active:
            self.computed[tasks[i].id] = tasks[i].num_tokens
        while active:
            seqs, token_ids, spans = [], [], []
            for i in active:
                task = tasks[i]
                # First the real tokens the cache lacks, then each guess as it is made.
                new = drafts[i][-1:] if drafts[i] else task.all_ids[fed[i] :]
                seqs.append((task.id, fed[i], len(new)))
                spans.append(len(task.prompt_ids))
                token_ids += new
                fed[i] += len(new)
            rows = np.cumsum([n for _, _, n in seqs]) - 1
            pages = cache.tasks.pages
            batch = StepBatch.build(seqs, token_ids, pages, cache.page_size, spans, rows)
            logits, _ = self.executor.forward(batch)
            guesses = argmax_rows(logits).tolist()
            for i, guess in zip(active, guesses, strict=True):
                drafts[i].append(guess)
            active = [i for i in active if len(drafts[i]) < lengths[i]]
        return drafts

    def forget(self, task: Task) -> None:
        self.cache.free(task.id)
        self.computed.pop(task.id, None)


class StepTimes:
    """Seconds a forward pass of n rows takes on this machine, learnt from the steps that ran
    (an exponential average per row count), so the policy weighs guesses at measured cost.

    The first step of a row count is left out: it records the step's kernel calls
    (executor.RecordedLayers), which later steps of that size replay at a fraction of its time.
    """

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.seconds: dict[int, float] = {}
        self.known: list[int] = []  # the keys of seconds, sorted: estimate() bisects them
        self.seen: set[int] = set()

    def record(self, rows: int, seconds: float) -> None:
        if rows not in self.seen:
            self.seen.add(rows)
            return
        old = self.seconds.get(rows)
        if old is None:
            bisect.insort(self.known, rows)
        self.seconds[rows] = seconds if old is None else old + self.smoothing * (seconds - old)

    def estimate(self, rows: int) -> float | None:
        """Interpolated between the row counts measured; past the largest, extended along the
        line through the two largest (flat while one is known: an optimistic guess that the
        next steps correct); flat below the smallest; None before any step ran."""
        if rows in self.seconds:
            return self.seconds[rows]
        known = self.known
        if not known:
            return None
        at = bisect.bisect(known, rows)  # known[:at] lie below rows, known[at:] above
        if at == 0:
            return self.seconds[known[0]]
        above = at < len(known)
        if above:
            low, high = known[at - 1], known[at]
        elif at > 1:
            low, high = known[at - 2], known[at - 1]
        else:
            return self.seconds[known[0]]
        slope = (self.seconds[high] - self.seconds[low]) / (high - low)
        return self.seconds[low] + (rows - low) * (slope if above else max(slope, 0.0))


@dataclass
class SpeculationStats:
    steps: int = 0  # verifications: speculative chunks that ran
    proposed: int = 0  # guessed tokens scored by the target
    accepted: int = 0  # guessed tokens kept

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted(self) -> float:
        """Guesses kept per verification (each verification also yields one token of its own)."""
        return self.accepted / self.steps if self.steps else 0.0


# A task's guesses start out trusted this much, and a task left out drifts back towards it, so
# one that stopped speculating tries again after a while.
PRIOR_RATE = 0.5
RATE_SMOOTHING = 0.3
RETRY_DRIFT = 1 / 32


class Speculator:
    """Turns a step's decode chunks into speculative ones where that is expected to pay.

    Per task it keeps the rate at which its guesses were kept (guess j is then kept with
    probability rate**j); per step it takes the guesses that give the most tokens expected per
    second, with step times measured on this machine. Guessing therefore stops for a task whose
    guesses miss and for a batch large enough that more rows cost more time (compute-bound),
    and resumes when the measurements say it pays again.
    """

    def __init__(self, proposer, num_tokens: int) -> None:
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.times = StepTimes()
        # task id -> [guesses kept, guesses judged] a check, averaged over its recent checks
        self.counts: dict[int, list[float]] = {}
        self.stats = SpeculationStats()

    def extend(self, chunks: list[ScheduledChunk], budget: int, cache: PagedCache) -> None:
        """Give decode chunks guesses, within the step's unused token budget and the free
        pages (no one is preempted for a guess)."""
        decodes = [c for c in chunks if c.length == 1 and c.samples]
        if not decodes or budget <= 0:
            return
        rows = sum(c.length for c in chunks)
        lengths = self._choose(decodes, [self._room(c.task, budget) for c in decodes], rows)
        drafts = self.proposer.propose([c.task for c in decodes], lengths)
        for chunk, length, draft in zip(decodes, lengths, drafts, strict=True):
            task = chunk.task
            if not length:
                self._average(task.id, PRIOR_RATE, 1.0, RETRY_DRIFT)
                continue
            draft, states = _grammar_prefix(task, draft[:budget])
            if not draft or not cache.allocate(task.id, task.num_tokens + len(draft)):
                continue
            chunk.draft = draft
            chunk.draft_states = states
            chunk.length += len(draft)
            budget -= len(draft)

    def _room(self, task: Task, budget: int) -> int:
        """Guesses the task can take: its output must stay within max_tokens with the
        target's own token after them."""
        left = task.params.max_tokens - len(task.output_ids) - 1
        return max(0, min(self.num_tokens, left, budget))

    def _choose(self, decodes: list[ScheduledChunk], lengths: list[int], rows: int) -> list[int]:
        """How many guesses each decode chunk gets (0: none). Guess j of a task is kept with
        probability rate**j, so guesses are taken most likely first, as many as give the step
        the most expected tokens per second at the step times measured. (Stopping at the first
        guess that did not raise it stopped at one guess of four that all paid: measured times
        of neighbouring row counts are not always in order.)"""
        rates = [self.rate(c.task.id) for c in decodes]
        increments = sorted(
            ((rates[i] ** j, i) for i, n in enumerate(lengths) for j in range(1, n + 1)),
            key=lambda item: item[0],
            reverse=True,
        )
        base = self.times.estimate(rows)
        taken = len(increments)  # all, until steps were timed
        if base is not None:
            tokens = float(len(decodes))
            best = tokens / base
            taken = 0
            for extra, (gain, _) in enumerate(increments, start=1):
                tokens += gain
                speed = tokens / self.times.estimate(rows + extra)
                if speed > best:
                    best, taken = speed, extra
        chosen = [0] * len(decodes)
        for _, i in increments[:taken]:
            chosen[i] += 1
        return chosen

    def timed(self, chunks: Sequence[ScheduledChunk], started: float) -> None:
        """Record the step's time from before the guessing, if the step was decodes only
        (prompt chunks cost otherwise)."""
        if all(c.length == 1 + len(c.draft) for c in chunks):
            self.times.record(sum(c.length for c in chunks), time.perf_counter() - started)

    def verified(self, chunk: ScheduledChunk) -> None:
        """Count a speculative chunk's outcome and update its task's rate: guesses kept over
        guesses judged, each averaged over recent checks. A guess after a check's first miss
        is never judged, and kept / proposed would count it a miss: on a workload that copies
        runs of tokens (a check keeps all its guesses or none) that halved the rate, and the
        policy took two guesses where four paid."""
        proposed = len(chunk.draft)
        self.stats.steps += 1
        self.stats.proposed += proposed
        self.stats.accepted += chunk.accepted
        if not chunk.task.is_finished:
            judged = chunk.accepted + (chunk.accepted < proposed)
            self._average(chunk.task.id, chunk.accepted, judged, RATE_SMOOTHING)

    def rate(self, task_id: int) -> float:
        """The task's guesses kept over guesses judged; PRIOR_RATE before its first check."""
        kept, judged = self.counts.get(task_id, (PRIOR_RATE, 1.0))
        return kept / judged

    def _average(self, task_id: int, kept: float, judged: float, weight: float) -> None:
        """Move the task's averages towards (kept, judged) by weight."""
        counts = self.counts.setdefault(task_id, [PRIOR_RATE, 1.0])
        counts[0] += weight * (kept - counts[0])
        counts[1] += weight * (judged - counts[1])

    def forget(self, task: Task) -> None:
        self.counts.pop(task.id, None)
        self.proposer.forget(task)


def _grammar_prefix(task: Task, draft: list[int]) -> tuple[list[int], list[ConstraintState] | None]:
    """The guesses a constrained task's grammar allows, up to the first it forbids (its mask
    would make the target reject it anyway), and the grammar's state after each of them,
    which the masks of the chunk's later rows need; None for an unconstrained task."""
    if task.constraint is None:
        return draft, None
    states: list[ConstraintState] = []
    state = task.constraint
    for token in draft:
        if token in task.stop_token_ids or state.is_finished():
            break
        state = state.fork()
        try:
            state.advance(token)
        except RuntimeError:
            break
        states.append(state)
    return draft[: len(states)], states
