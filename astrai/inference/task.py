"""Requests inside the engine: sampling settings, the Task lifecycle and the queue to the loop."""

from __future__ import annotations

import itertools
import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from astrai.config import setting
from astrai.inference.constraints import Constraint, ConstraintState
from astrai.inference.stop_strings import StopStringMatcher

if TYPE_CHECKING:
    import torch

    from astrai.inference.mrope import MRopePositions
    from astrai.model.lora import LoraAdapter


class RequestError(ValueError):
    """A request the engine refuses; the message says what was wrong and what to do."""


class InvalidParamsError(RequestError):
    """A generation parameter is out of its allowed range."""


class PromptTooLongError(RequestError):
    """A prompt plus its max_tokens cannot fit in max_seq_len or in the KV pool."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int, what: str) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.limit = limit
        if not max_tokens:  # a prompt-only request (prompt logprobs, an embedding)
            super().__init__(
                f"the prompt has {prompt_tokens} tokens, but {what} is {limit} tokens; "
                "shorten the prompt"
            )
            return
        super().__init__(
            f"the prompt has {prompt_tokens} tokens and {max_tokens} new tokens were asked for "
            f"({prompt_tokens + max_tokens} in all), but {what} is {limit} tokens; "
            "shorten the prompt or lower max_tokens"
        )


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full; the caller should retry later."""


class EngineClosedError(RuntimeError):
    """The engine was closed (or its loop crashed), so it takes no more requests."""


class GenerationError(RuntimeError):
    """An accepted request ended in an error, such as a failed model step."""


class RequestAbortedError(RuntimeError):
    """An accepted request ended before it finished: it was aborted or the engine shut down."""


def _check_range(
    name: str, value: Any, low: float, high: float, *, integer: bool = False, open_low: bool = False
) -> None:
    bounds = f"{'(' if open_low else '['}{low}, {high}]"
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
        raise InvalidParamsError(
            f"{name} must be {'an integer' if integer else 'a number'} in {bounds}, got {value!r}"
        )
    if value > high or value < low or (open_low and value == low):
        raise InvalidParamsError(f"{name} must be in {bounds}, got {value!r}")


MAX_LOGPROBS = 20
# OpenAI's range for a logit bias; larger values are clamped to it, as vLLM does.
MAX_LOGIT_BIAS = 100.0
# Generous for any real use (OpenAI allows 4 stop strings), and they bound the stop matcher a
# request can make the engine build: about 0.3 KB and 10 us of CPU per character.
MAX_STOP_STRINGS = 256
MAX_STOP_CHARS = 4096


def _checked_logit_bias(logit_bias: Any) -> dict[int, float] | None:
    """The bias map with its values clamped to MAX_LOGIT_BIAS; None when empty."""
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise InvalidParamsError(
            f"logit_bias must map token ids to numbers, got {type(logit_bias).__name__}"
        )
    checked = {}
    for token_id, bias in logit_bias.items():
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise InvalidParamsError(
                f"logit_bias keys must be non-negative token ids, got {token_id!r}"
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float) or math.isnan(bias):
            raise InvalidParamsError(f"logit_bias[{token_id}] must be a number, got {bias!r}")
        checked[token_id] = min(max(float(bias), -MAX_LOGIT_BIAS), MAX_LOGIT_BIAS)
    return checked or None


def parse_logit_bias(text: str) -> dict[int, float]:
    """A logit_bias from text such as "123=-100,456=5" (the command line's form)."""
    logit_bias = {}
    for item in text.split(","):
        token_id, _, bias = item.partition("=")
        try:
            logit_bias[int(token_id)] = float(bias)
        except ValueError:
            raise InvalidParamsError(
                f"expected ID=BIAS pairs separated by commas, such as 123=-100, got {text!r}"
            ) from None
    return logit_bias


@dataclass(frozen=True)
class ThinkingBudget:
    """At most `tokens` tokens of thinking: once that many are generated without end_ids (a
    reasoning model's </think>) among them, end_ids are forced next, one token a step."""

    tokens: int
    end_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_range("thinking_budget's tokens", self.tokens, 0, 1 << 30, integer=True)
        ends = tuple(self.end_ids)
        if not ends or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ends):
            raise InvalidParamsError(
                "thinking_budget's end_ids must be one or more non-negative token ids, got "
                f"{self.end_ids!r}"
            )
        object.__setattr__(self, "end_ids", ends)

    @classmethod
    def parse(cls, text: str) -> ThinkingBudget:
        """A budget from text such as "512:151668" (the command line's form)."""
        tokens, _, ids = text.partition(":")
        try:
            return cls(int(tokens), tuple(int(i) for i in ids.split(",")))
        except ValueError:
            raise InvalidParamsError(
                f"expected N:ID[,ID...], tokens and the ids that end thinking, such as "
                f"512:151668, got {text!r}"
            ) from None

    def forced_token(self, output_ids: Sequence[int]) -> int | None:
        """The token forced after output_ids, or None: thinking that ended on its own (end_ids
        within the budget's tokens) is left alone, and end_ids are forced once each."""
        if len(output_ids) < self.tokens:
            return None
        forced = len(output_ids) - self.tokens
        if forced >= len(self.end_ids) or self._ended(output_ids[: self.tokens]):
            return None
        return self.end_ids[forced]

    def _ended(self, ids: Sequence[int]) -> bool:
        size, ends = len(self.end_ids), list(self.end_ids)
        return any(list(ids[i : i + size]) == ends for i in range(len(ids) - size + 1))


@dataclass(frozen=True)
class GenerationParams:
    """Immutable sampling and stopping settings of one request; validated on construction.

    temperature 0 is greedy. top_k 0 and top_p 1 switch those filters off. logprobs None
    returns none, 0 returns the chosen token's logprob, k > 0 adds the top-k alternatives;
    prompt_logprobs does the same for each prompt token after the first. max_tokens 0 computes
    the prompt only (its prompt_logprobs) and generates nothing.
    logit_bias, allowed_token_ids and stop_token_ids are checked against the model's vocabulary
    when the engine takes the request; a constraint is compiled then too.
    """

    max_tokens: int = setting(128, "most tokens to generate; 0 computes the prompt only")
    temperature: float = setting(1.0, "softmax temperature; 0 is greedy", metavar="T")
    top_p: float = setting(
        1.0,
        "nucleus sampling: keep the smallest set of tokens whose probability reaches this; "
        "1 is off",
        metavar="P",
    )
    top_k: int = setting(0, "keep only the k most likely tokens; 0 is off")
    min_p: float = setting(
        0.0, "drop tokens less likely than this times the most likely one; 0 is off", metavar="P"
    )
    repetition_penalty: float = setting(
        1.0, "above 1 makes tokens already in the prompt or output less likely; 1 is off"
    )
    presence_penalty: float = setting(
        0.0, "subtract this from the logits of tokens already generated; 0 is off"
    )
    frequency_penalty: float = setting(
        0.0, "subtract this times its count so far from each generated token's logit; 0 is off"
    )
    seed: int | None = setting(None, "seed for reproducible sampling")
    stop: tuple[str, ...] = setting((), "stop when this text appears (not printed); repeatable")
    stop_token_ids: tuple[int, ...] = setting(
        (), "stop when this token id is generated; repeatable"
    )
    ignore_eos: bool = setting(False, "keep generating past end-of-sequence tokens")
    logprobs: int | None = setting(
        None, "log probabilities to return: 0 for the chosen token, k for top k"
    )
    prompt_logprobs: int | None = setting(
        None,
        "log probabilities of the prompt's tokens after the first: 0 for each token's own, k "
        "adds the top k",
    )
    n: int = setting(1, "samples to generate per prompt")
    logit_bias: dict[int, float] | None = setting(
        None,
        "add BIAS to token ID's logit before sampling, clamped to [-100, 100]: -100 bans it, "
        "100 forces it",
        metavar="ID=BIAS[,ID=BIAS...]",
        parse=parse_logit_bias,
    )
    allowed_token_ids: tuple[int, ...] = setting(
        (), "sample only these token ids; repeatable; none means any"
    )
    min_tokens: int = setting(
        0, "generate at least this many tokens before EOS, a stop token or a stop string ends"
    )
    constraint: Constraint | None = setting(
        None,
        "constrain the output to this JSON schema (JSON text); the API also takes regexes, "
        "choices and grammars",
        flag="--json-schema",
        metavar="SCHEMA",
        parse=Constraint.json_schema,
    )
    thinking_budget: ThinkingBudget | None = setting(
        None,
        "think at most N tokens: once N are generated without the ids that end thinking (a "
        "reasoning model's </think>) among them, those ids are forced next",
        metavar="N:ID[,ID...]",
        parse=ThinkingBudget.parse,
    )
    lora: str | None = setting(
        None,
        "the LoRA adapter (a --lora NAME) that generates; with one --lora, that one",
        flag="--use-lora",
        metavar="NAME",
    )

    def __post_init__(self) -> None:
        _check_range("max_tokens", self.max_tokens, 0, 1 << 30, integer=True)
        _check_range("temperature", self.temperature, 0.0, 100.0)
        _check_range("top_p", self.top_p, 0, 1, open_low=True)
        _check_range("top_k", self.top_k, 0, 1 << 30, integer=True)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0, 100, open_low=True)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _check_range("seed", self.seed, -(1 << 63), (1 << 63) - 1, integer=True)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidParamsError(f"stop must be non-empty strings, got {self.stop!r}")
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidParamsError(
                f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed"
            )
        if sum(map(len, stop)) > MAX_STOP_CHARS:
            raise InvalidParamsError(
                f"the stop strings hold {sum(map(len, stop))} characters in all; at most "
                f"{MAX_STOP_CHARS} are allowed"
            )
        object.__setattr__(self, "stop", stop)
        stop_ids = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop_ids):
            raise InvalidParamsError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", stop_ids)
        if self.logprobs is not None:
            _check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS, integer=True)
        if self.prompt_logprobs is not None:
            _check_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, integer=True)
        _check_range("n", self.n, 1, 128, integer=True)
        object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))
        allowed = tuple(self.allowed_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in allowed):
            raise InvalidParamsError(
                f"allowed_token_ids must be non-negative integers, got {self.allowed_token_ids!r}"
            )
        object.__setattr__(self, "allowed_token_ids", allowed)
        _check_range("min_tokens", self.min_tokens, 0, self.max_tokens, integer=True)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InvalidParamsError(
                "constraint must be a Constraint (Constraint.json_schema(...), .regex(...), "
                f".choice(...), .grammar(...), .json_object()), got {self.constraint!r}"
            )

        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise InvalidParamsError(f"lora must be an adapter's name, got {self.lora!r}")
        if self.thinking_budget is not None:
            if not isinstance(self.thinking_budget, ThinkingBudget):
                raise InvalidParamsError(
                    f"thinking_budget must be a ThinkingBudget, got {self.thinking_budget!r}"
                )
            if self.constraint is not None:
                raise InvalidParamsError(
                    "thinking_budget forces tokens that a constraint may forbid; give one of them"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property
    def stop_matcher(self) -> StopStringMatcher | None:
        """The stop strings as one automaton, built once for every task of these params."""
        return StopStringMatcher(self.stop) if self.stop else None


class TaskStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


class _Stop:
    """The end-of-stream sentinel: a task's callback gets it exactly once, last."""

    def __repr__(self) -> str:
        return "STOP"


STOP = _Stop()


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # a prompt token's place among the vocabulary's logits, 1 the top


@dataclass
class TaskDelta:
    """What one step added to a task: new text (stop-string candidates held back) and ids."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    # Prompt tokens the prefix cache served; fixed from the first delta on, so a stream can
    # report its input usage before the result arrives.
    cached_tokens: int = 0
    # This token ended the task: the delta is its last, and its result comes next.
    last: bool = False
    # The prompt's logprobs (GenerationParams.prompt_logprobs), on the first delta only.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class TaskResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None
    # One entry per prompt token, the first None (nothing predicts it); with prompt_logprobs.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # An embedding task's pooled final hidden states, float32 [dim], not normalized.
    embedding: torch.Tensor | None = None

    def raise_for_status(self) -> None:
        """Raise the engine's typed error if the task ended without finishing.

        The one place where an "error" or "abort" finish reason becomes an exception, so the
        engine's and the server's callers agree on what a failed sample is.
        """
        if self.finish_reason == "error":
            raise GenerationError(f"generation failed: {self.error}")
        if self.finish_reason == "abort":
            reason = f": {self.error}" if self.error else ""
            raise RequestAbortedError(f"the request was aborted{reason}")


class Detokenizer(Protocol):
    def add(self, token_id: int) -> str: ...


TaskCallback = Callable[["Task", "TaskDelta | _Stop"], None]

_task_ids = itertools.count()


@dataclass(eq=False)
class PromptImage:
    """One image of a prompt (one tile of it, for a model that tiles images): its pixel values,
    a digest of them (part of the prefix cache's key), and the prompt positions
    start .. end - 1 of its placeholder tokens.

    embeddings [end - start, dim] are the vision encoder's output, made by the first step that
    computes one of its placeholders and dropped once the prompt is computed past them; a task
    preempted after that encodes the pixels again for its recompute.
    """

    pixel_values: torch.Tensor  # [3, height, width]; Qwen2-VL: its patches (qwen2_vl_processor)
    digest: bytes
    start: int
    length: int
    # The (t, h, w) grid its tokens lie on, row-major, for a model with M-RoPE; else None.
    grid: tuple[int, int, int] | None = None
    # Its tokens attend to each other (Gemma 3), so one prefill chunk computes them all.
    bidirectional: bool = False
    # [length] int64: the row of the encoder's output each placeholder takes (LLaVA-NeXT);
    # None where placeholder i takes row i.
    feature_rows: torch.Tensor | None = None
    embeddings: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + self.length


class Task:
    """One sequence being generated: its tokens, how much of it the KV cache holds, its text.

    The scheduler thread owns every field once the task is queued; other threads only read
    the result after the callback got STOP.
    """

    def __init__(
        self,
        prompt_ids: Sequence[int],
        params: GenerationParams,
        callback: TaskCallback,
        detokenizer: Detokenizer,
        stop_token_ids: frozenset[int] = frozenset(),
        parent: Task | None = None,
        constraint: ConstraintState | None = None,
        adapter: LoraAdapter | None = None,
        pooling: str | None = None,
        images: Sequence[PromptImage] = (),
        mrope: MRopePositions | None = None,
    ) -> None:
        """pooling ("last" or "mean") makes an embedding task, which has max_tokens 0."""
        self.id = next(_task_ids)
        self.prompt_ids = list(prompt_ids)
        # The prompt's images, in the order of their placeholder tokens (shared by the samples
        # of one prompt).
        self.images = list(images)
        # M-RoPE's positions of a prompt with images (Qwen2-VL), shared by the samples of one
        # prompt; None where every token's rope position is its index.
        self.mrope = mrope
        self.params = params
        self.callback = callback
        self.parent = parent
        self.status = TaskStatus.WAITING
        self.output_ids: list[int] = []
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        # Where the output is in its constraint; it moves only with a token appended, so a
        # preempted task recomputes its K/V and keeps its state, and a step that is rerun
        # samples from the same masks.
        self.constraint = constraint
        self.adapter = adapter  # the LoRA adapter it generates under, None for the base model
        # What its KV depends on besides its tokens (its adapter, its rope's regime), which the
        # prefix cache keys its pages under: None for the base model's plain rotation.
        self.kv_root: bytes | None = None
        self.pooling = pooling
        # Filled chunk by chunk as the prompt is computed; the samples of one prompt share its
        # prompt logprobs, so the first computes them.
        wants_prompt_logprobs = params.prompt_logprobs is not None and parent is None
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if wants_prompt_logprobs else None
        )
        self.embedding: torch.Tensor | None = None
        self._detokenizer = detokenizer
        self._stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else stop_token_ids
        )
        self._text = ""  # all text decoded so far
        self._emitted = 0  # how much of _text went out through the callback
        # The samples of one prompt differ in their seed alone: they share the first's matcher.
        self._stop_matcher = parent._stop_matcher if parent is not None else params.stop_matcher
        self._stop_state = 0  # the matcher's state after all of _text

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in (TaskStatus.FINISHED, TaskStatus.ABORTED, TaskStatus.FAILED)

    @property
    def prompt_only(self) -> bool:
        """A task that ends once its prompt is computed (max_tokens 0: its prompt logprobs, or
        an embedding), sampling nothing."""
        return self.params.max_tokens == 0

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether the prompt's chunks still owe this task prompt logprobs."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether admission may reuse cached prompt pages: not while every prompt position's
        output is needed, since a cached page holds K/V, not the logits of prompt logprobs or
        the hidden states of a mean."""
        return not self.needs_prompt_logprobs and self.pooling != "mean"

    def add_prompt_logprobs(self, start: int, entries: list[TokenLogprob]) -> None:
        """Add the logprobs of prompt tokens start + 1 on, which a chunk from position start
        computed; a chunk from 0 (the first, or a preempted task's recompute) starts anew.

        Chunks that compute them follow each other from 0: such a task reads no cached pages.
        """
        if start == 0:
            self.prompt_logprobs = [None]
        self.prompt_logprobs.extend(entries)

    def add_pooled(self, start: int, pooled: torch.Tensor) -> None:
        """Add what a chunk from position start pooled: for "last" the prompt's last hidden
        state, for "mean" the sum of the chunk's (a chunk from 0 starts the sum anew)."""
        if self.pooling == "last" or start == 0:
            self.embedding = pooled
        else:
            self.embedding = self.embedding + pooled

    def end_prompt(self) -> None:
        """End a prompt-only task, its prompt computed: a mean's sum becomes the mean."""
        if self.pooling == "mean":
            self.embedding = self.embedding / len(self.prompt_ids)
        self.end(TaskStatus.FINISHED, "length")

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The token ids that end this task: its own and, unless ignore_eos, the model's EOS."""
        return self._stop_ids

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> TaskDelta:
        """Add a sampled token, check the stop conditions and return the text it releases.

        A constrained task ends (reason "stop") as soon as its output is complete.
        """
        stop_token = token_id in self._stop_ids
        if self.constraint is not None and not stop_token:
            self.constraint.advance(token_id)  # raises, changing nothing, on a disallowed token
        self.output_ids.append(token_id)
        if stop_token:
            self.end(TaskStatus.FINISHED, "stop", stop_reason=token_id)
        else:
            text = self._detokenizer.add(token_id)
            self._text += text
            stopped = self._cut_at_stop_string(text)
            if not stopped and self.constraint is not None and self.constraint.is_finished():
                self.end(TaskStatus.FINISHED, "stop")
            elif not stopped and len(self.output_ids) >= self.params.max_tokens:
                self.end(TaskStatus.FINISHED, "length")
        end = len(self._text) if self.is_finished else len(self._text) - self._held_back()
        piece = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        logprobs = None if logprob is None else [logprob]
        prompt_logprobs = self.prompt_logprobs if len(self.output_ids) == 1 else None
        return TaskDelta(
            piece, [token_id], logprobs, self.cached_tokens, self.is_finished, prompt_logprobs
        )

    def _cut_at_stop_string(self, text: str) -> bool:
        """Finish at the earliest stop string that the new text completes, if there is one.

        Only the new text is fed to the matcher: what came before is in its state. Before
        min_tokens tokens a stop string is passed over, as vLLM does.
        """
        if self._stop_matcher is None:
            return False
        self._stop_state, found = self._stop_matcher.feed(self._stop_state, text)
        if found is None or len(self.output_ids) < self.params.min_tokens:
            return False
        start, stop = found
        self._text = self._text[: len(self._text) - len(text) + start]
        self.end(TaskStatus.FINISHED, "stop", stop_reason=stop)
        return True

    def _held_back(self) -> int:
        """Length of the longest text suffix that could still grow into a stop string."""
        if self._stop_matcher is None:
            return 0
        return self._stop_matcher.held_back(self._stop_state)

    def end(
        self,
        status: TaskStatus,
        reason: str,
        error: str | None = None,
        stop_reason: str | int | None = None,
    ) -> None:
        """Mark the task finished (reason "stop" or "length"), aborted or failed."""
        self.status = status
        self.finish_reason = reason
        self.error = error
        self.stop_reason = stop_reason

    def result(self) -> TaskResult:
        return TaskResult(
            text=self._text[: self._emitted] if self.is_finished else self._text,
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason or "",
            stop_reason=self.stop_reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens,
            error=self.error,
            prompt_logprobs=self.prompt_logprobs,
            embedding=self.embedding,
        )


class TaskManager:
    """The lock-protected hand-off between caller threads and the scheduler loop.

    Callers add tasks and ask for aborts; the loop drains both at the top of every step and
    sleeps on the event when there is nothing to do.
    """

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self._waiting: deque[Task] = deque()
        # Appending to a deque needs no lock, so abort() is safe from finalizers on any thread.
        self._aborts: deque[int] = deque()
        self._closed = False
        self.wakeup = threading.Event()

    def add_tasks(self, tasks: Sequence[Task]) -> None:
        """Queue every task or, if the queue has no room for all of them, none."""
        if len(tasks) > self.max_waiting:  # retrying would never help
            raise RequestError(
                f"the request needs {len(tasks)} places in the waiting queue, which holds "
                f"{self.max_waiting}; send fewer prompts or samples (n) at once"
            )
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is closed; create a new one")
            if len(self._waiting) + len(tasks) > self.max_waiting:
                raise QueueFullError(
                    f"the waiting queue is full ({self.max_waiting} requests); retry later"
                )
            self._waiting.extend(tasks)
        self.wakeup.set()

    def close(self) -> None:
        """Refuse every task from now on, so none can slip in after the loop's last look at
        the queue; the tasks already queued stay there for the loop to end."""
        with self._lock:
            self._closed = True

    def abort(self, task_id: int) -> None:
        self._aborts.append(task_id)
        self.wakeup.set()

    def take_aborts(self) -> set[int]:
        aborts = set()
        while self._aborts:
            aborts.add(self._aborts.popleft())
        return aborts

    def waiting(self) -> list[Task]:
        with self._lock:
            return list(self._waiting)

    def remove_waiting(self, task: Task) -> None:
        with self._lock:
            self._waiting.remove(task)

    def requeue_front(self, task: Task) -> None:
        """Put a preempted task back at the head of the queue, ahead of new arrivals."""
        with self._lock:
            self._waiting.appendleft(task)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)
