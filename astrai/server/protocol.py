"""Request bodies of the OpenAI and Anthropic APIs; unknown fields are ignored, not refused.

Ranges of sampling parameters are checked by GenerationParams, not here, so the engine and the
server refuse the same values with the same messages.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


def _unicode(text: str) -> str:
    """Refuse lone surrogates, which no tokenizer can encode.

    They come from escapes such as "\\ud800" or from invalid UTF-8 in the body, which the JSON
    decoder passes through as surrogates.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"the text holds an invalid character at position {exc.start} (a lone surrogate "
            "such as \\ud800, or bytes that are not UTF-8); send valid Unicode text"
        ) from None
    return text


def _unicode_strings(value: Any) -> Any:
    """value, once every string in it (a str or a list of them) passed _unicode."""
    if isinstance(value, str):
        _unicode(value)
    elif isinstance(value, list):
        for item in value:
            _unicode_strings(item)
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _text_of(content: Any) -> str:
    """The text of a message content: a string or a list of text parts/blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return _unicode(content)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"only text content parts are supported, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError("a text content part needs a string 'text' field")
        texts.append(part["text"])
    return _unicode("".join(texts))


# OpenAI


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant"]
    content: str | list[Any] | None = None

    @field_validator("content")
    @classmethod
    def _only_text(cls, content: str | list[Any] | None) -> str:
        return _text_of(content)


class StreamOptions(_Request):
    include_usage: bool = False


class _OpenAISampling(_Request):
    """Fields shared by chat completions and completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions, for benchmarks and tests that need a fixed output length.
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    _text = field_validator("model", "stop")(_unicode_strings)


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and (not prompt or any(p in ("", []) for p in prompt)):
            raise ValueError("prompt must not be empty")
        return _unicode_strings(prompt)


# Anthropic


class AnthropicMessage(_Request):
    role: Literal["user", "assistant"]
    content: str | list[Any]

    @field_validator("content")
    @classmethod
    def _only_text(cls, content: str | list[Any]) -> str:
        return _text_of(content)


class _AnthropicPrompt(_Request):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[Any] | None = None

    _text = field_validator("model")(_unicode_strings)

    @field_validator("system")
    @classmethod
    def _system_text(cls, system: str | list[Any] | None) -> str | None:
        return None if system is None else _text_of(system)


class MessagesRequest(_AnthropicPrompt):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False

    _stop_text = field_validator("stop_sequences")(_unicode_strings)


class CountTokensRequest(_AnthropicPrompt):
    pass
