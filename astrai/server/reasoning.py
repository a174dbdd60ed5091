"""Reasoning in model output: a think block's text apart from the answer, for whole texts and
streams, one parser per format behind a registry.

Qwen3, the DeepSeek-R1 distills and SmolLM3 think in <think>...</think> before they answer; a
chat template may open the block itself (the R1 distills' ends the prompt with "<think>\\n"), so
a parser is told whether the prompt left one open. One streaming splitter reads whole texts and
streams alike, so a streamed answer concatenates to the answer split from the whole text. The
engine knows nothing of thinking beyond the token ids it forces once a budget is spent
(GenerationParams.thinking_budget).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ReasoningParser:
    """A format of think blocks: the markers that open and close one at the answer's start.

    The reasoning is the block's text without the whitespace around it; the answer is what
    follows the block, without the whitespace before it.
    """

    name = "think"
    start = "<think>"
    end = "</think>"
    # How many of the prompt's last tokens can hold a generation prompt that opens a block.
    _PROMPT_TAIL_TOKENS = 32

    def opened_by(self, tokenizer: Any, prompt: Sequence[int]) -> bool:
        """Whether the prompt ends inside a think block its chat template opened."""
        tail = tokenizer.decode(
            list(prompt[-self._PROMPT_TAIL_TOKENS :]), skip_special_tokens=False
        )
        return tail.rfind(self.start) > tail.rfind(self.end)

    def stream(self, opened: bool) -> ReasoningStream:
        return ReasoningStream(self, opened)

    def split(self, text: str, opened: bool) -> tuple[str | None, str]:
        """The reasoning (None when the text has no think block, or an empty one) and the
        answer."""
        stream = self.stream(opened)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning) or None, content + more_content

    def reasoning_tokens(self, tokenizer: Any, token_ids: Sequence[int], opened: bool) -> int:
        """How many of an answer's tokens are its think block: up to the one that closes it
        (all of them for a block left open, none without a block)."""
        reasoning, _ = self.split(tokenizer.decode(list(token_ids)), opened)
        if reasoning is None:
            return 0
        # The fewest tokens whose text closes the block, found by bisection.
        low, high = 0, len(token_ids)
        while low < high:
            middle = (low + high) // 2
            if self._closed(tokenizer.decode(list(token_ids[:middle])), opened):
                high = middle
            else:
                low = middle + 1
        return low

    def _closed(self, text: str, opened: bool) -> bool:
        if not opened:
            text = text.lstrip().removeprefix(self.start)
        return self.end in text


class ReasoningStream:
    """Splits streamed text into reasoning and answer, holding back what may yet be a marker
    or whitespace that the split drops."""

    def __init__(self, parser: ReasoningParser, opened: bool) -> None:
        self._parser = parser
        self._state = "reasoning_start" if opened else "start"
        self._pending = ""

    def feed(self, piece: str) -> tuple[str, str]:
        """The reasoning and the answer text that piece adds."""
        self._pending += piece
        reasoning = content = ""
        while True:
            state = self._state
            if state == "start":
                stripped = self._pending.lstrip()
                if stripped.startswith(self._parser.start):
                    self._pending = stripped[len(self._parser.start) :]
                    self._state = "reasoning_start"
                elif not self._parser.start.startswith(stripped):
                    self._state = "content"
                else:
                    return reasoning, content
            elif state in ("reasoning_start", "content_start"):
                self._pending = self._pending.lstrip()
                if not self._pending:
                    return reasoning, content
                self._state = state.removesuffix("_start")
            elif state == "reasoning":
                at = self._pending.find(self._parser.end)
                if at >= 0:
                    reasoning += self._pending[:at].rstrip()
                    self._pending = self._pending[at + len(self._parser.end) :]
                    self._state = "content_start"
                    continue
                keep = self._pending[: self._safe_end(self._pending)].rstrip()
                reasoning += keep
                self._pending = self._pending[len(keep) :]
                return reasoning, content
            else:
                content += self._pending
                self._pending = ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back at the end: an open block's text, or the answer's."""
        pending, self._pending = self._pending, ""
        if self._state.startswith("reasoning"):
            return pending.rstrip(), ""
        return "", "" if self._state == "content_start" else pending

    def _safe_end(self, text: str) -> int:
        """How much of text cannot be the start of the end marker."""
        end = self._parser.end
        for size in range(min(len(end) - 1, len(text)), 0, -1):
            if text.endswith(end[:size]):
                return len(text) - size
        return len(text)


class ThinkParser(ReasoningParser):
    """<think>...</think>: Qwen3, the DeepSeek-R1 distills, SmolLM3."""


# vLLM's names for the same format are accepted too, so its command lines carry over.
PARSERS: dict[str, type[ReasoningParser]] = {
    "think": ThinkParser,
    "qwen3": ThinkParser,
    "deepseek_r1": ThinkParser,
}


def reasoning_parser_for(name: str | None, chat_templates: Sequence[str]) -> ReasoningParser | None:
    """The parser named (one of PARSERS), or the think parser when a chat template mentions
    <think>, or None."""
    if name is not None:
        if name not in PARSERS:
            raise ValueError(
                f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(PARSERS))}"
            )
        return PARSERS[name]()
    if any(ThinkParser.start in template for template in chat_templates):
        return ThinkParser()
    return None
