"""Requests inside the engine: sampling settings, the Task lifecycle and the queue to the loop."""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


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
        super().__init__(
            f"the prompt has {prompt_tokens} tokens and {max_tokens} new tokens were asked for "
            f"({prompt_tokens + max_tokens} in all), but {what} is {limit} tokens; "
            "shorten the prompt or lower max_tokens"
        )


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full; the caller should retry later."""


def _check_range(name: str, value: Any, low: float, high: float, *, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
        raise InvalidParamsError(
            f"{name} must be {'an integer' if integer else 'a number'} in [{low}, {high}], "
            f"got {value!r}"
        )
    if not low <= value <= high:
        raise InvalidParamsError(f"{name} must be in [{low}, {high}], got {value!r}")


MAX_LOGPROBS = 20


@dataclass(frozen=True)
class GenerationParams:
    """Immutable sampling and stopping settings of one request; validated on construction.

    temperature 0 is greedy. top_k 0 and top_p 1 switch those filters off. logprobs None
    returns none, 0 returns the chosen token's logprob, k > 0 adds the top-k alternatives.
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        _check_range("max_tokens", self.max_tokens, 1, 1 << 30, integer=True)
        _check_range("temperature", self.temperature, 0.0, 100.0)
        top_p_is_number = isinstance(self.top_p, int | float) and not isinstance(self.top_p, bool)
        if not top_p_is_number or not 0.0 < self.top_p <= 1.0:
            raise InvalidParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_range("top_k", self.top_k, 0, 1 << 30, integer=True)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if not isinstance(self.repetition_penalty, int | float) or not (
            0.0 < self.repetition_penalty <= 100.0
        ):
            raise InvalidParamsError(
                f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}"
            )
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _check_range("seed", self.seed, -(1 << 63), (1 << 63) - 1, integer=True)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidParamsError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        stop_ids = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop_ids):
            raise InvalidParamsError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", stop_ids)
        if self.logprobs is not None:
            _check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS, integer=True)
        _check_range("n", self.n, 1, 128, integer=True)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
