"""Request bodies of the OpenAI, Anthropic, Ollama and vLLM-extension APIs; unknown fields are
refused.

Every field of OpenAI's, Anthropic's, Ollama's and the known vLLM request schemas is declared here.
Fields typed Any are ones astrai does not honour: astrai.server.fields says which of their values
ask for nothing and refuses the rest, and docs/api.md lists every field's status.

Ranges of sampling parameters are checked by GenerationParams, not here, so the engine and the
server refuse the same values with the same messages.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from astrai.server.tool_parsers import ToolChoice, ToolRequest


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
    # Every field of the published schemas is declared, so a key that is not one is a mistake
    # (or a feature astrai has never heard of): refusing it beats dropping it in silence.
    model_config = ConfigDict(extra="forbid")


# Keys of a text content part: OpenAI's, and Anthropic's cache_control, which astrai's automatic
# prefix cache makes a no-op.
_TEXT_PART_KEYS = frozenset({"type", "text", "cache_control"})


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
        unknown = sorted(key for key, value in part.items() if key not in _TEXT_PART_KEYS and value)
        if unknown:
            raise ValueError(
                f"a text content part's {unknown[0]!r} is not supported by astrai; leave it out"
            )
        texts.append(part["text"])
    return _unicode("".join(texts))


@dataclass(frozen=True)
class RequestImage:
    """An image a message carries: the bytes of its file, decoded (within the engine's limits)
    when the prompt is built; or url, the http(s) URL the server fetches them from, if the
    operator allows its host (astrai.server.media)."""

    data: bytes = b""
    url: str | None = None


def _base64_image(data: Any, what: str) -> RequestImage:
    if not isinstance(data, str):
        raise ValueError(f"{what} must be a base64 string")
    try:
        return RequestImage(base64.b64decode(data, validate=True))
    except binascii.Error:
        raise ValueError(f"{what} is not valid base64") from None


def _openai_image(part: dict) -> RequestImage:
    """An OpenAI image_url part's image, from its data: URL (or its http(s) URL, fetched if the
    operator allows the host)."""
    image_url = part.get("image_url")
    unknown = sorted(set(part) - {"type", "image_url"})
    if unknown:
        raise ValueError(f"an image_url part's {unknown[0]!r} is not supported by astrai")
    if isinstance(image_url, str):  # some clients send the URL itself
        image_url = {"url": image_url}
    if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
        raise ValueError("an image_url part needs image_url.url, a data: URL")
    if image_url.get("detail", "auto") != "auto":
        raise ValueError(
            f"image_url.detail {image_url['detail']!r} is not supported: the model sees every "
            "image at its one resolution; leave detail out or send 'auto'"
        )
    unknown = sorted(set(image_url) - {"url", "detail"})
    if unknown:
        raise ValueError(f"image_url's {unknown[0]!r} is not supported by astrai")
    url = image_url["url"]
    if url.startswith(("http://", "https://")):
        return RequestImage(url=url)
    header, comma, payload = url.partition(",")
    if not header.startswith("data:") or not comma:
        raise ValueError(
            "image_url.url must be a data: URL, data:image/png;base64,..., or an http(s) URL"
        )
    if not header.endswith(";base64"):
        raise ValueError("image_url.url's data: URL must hold base64 data (data:...;base64,...)")
    return _base64_image(payload, "image_url.url's data")


def _anthropic_image(block: dict) -> RequestImage:
    """An Anthropic image block's image, from its base64 source (or its url source, fetched if
    the operator allows the host)."""
    unknown = sorted(key for key in block if key not in ("type", "source", "cache_control"))
    if unknown:
        raise ValueError(f"an image block's {unknown[0]!r} is not supported by astrai")
    source = block.get("source")
    if not isinstance(source, dict):
        raise ValueError("an image block needs a source object")
    if source.get("type") == "url":
        if not isinstance(source.get("url"), str):
            raise ValueError("an image block's url source needs a string url")
        return RequestImage(url=source["url"])
    if source.get("type") != "base64":
        raise ValueError(
            "an image block's source.type must be 'base64' (with media_type, data) or 'url'"
        )
    return _base64_image(source.get("data"), "the image block's source.data")


def _parts_of(items: list[Any]) -> str | list[str | RequestImage]:
    """Text parts and RequestImages as a message's content: its text alone where there is no
    image, else its text pieces and images in order."""
    parts: list[str | RequestImage] = []
    for item in items:
        if isinstance(item, RequestImage):
            parts.append(item)
        elif parts and isinstance(parts[-1], str):
            parts[-1] += _text_of([item])
        else:
            parts.append(_text_of([item]))
    if not any(isinstance(part, RequestImage) for part in parts):
        return "".join(parts)
    return parts


# OpenAI


class FunctionCall(_Request):
    name: str
    arguments: str  # a JSON object, as the model wrote it


class MessageToolCall(_Request):
    """A call an assistant message made, as OpenAI's responses give it."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    """A chat message. A role other than OpenAI's goes to the chat template as it is, and a key
    astrai does not know goes to it as one of the message's variables, as vLLM hands them;
    GenerationService refuses what the template would drop."""

    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1)
    content: str | list[Any] | None = None
    name: Any = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    refusal: Any = None
    audio: Any = None
    annotations: Any = None

    _role_text = field_validator("role")(_unicode_strings)

    @field_validator("content")
    @classmethod
    def _text_and_images(cls, content: str | list[Any] | None) -> str | list:
        """The text, or text pieces and images (image_url parts) in order."""
        if not isinstance(content, list):
            return _text_of(content)
        return _parts_of(
            [
                _openai_image(p) if isinstance(p, dict) and p.get("type") == "image_url" else p
                for p in content
            ]
        )

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message may carry tool_calls")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("a tool message needs a tool_call_id, and only a tool message has one")
        for call in self.tool_calls or ():
            if not isinstance(_json_or_none(call.function.arguments), dict):
                raise ValueError(
                    f"the arguments of tool call {call.id!r} must be a JSON object in a string"
                )
        return self

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates take it, as transformers hands it: OpenAI's developer
        role is their system, and a call's arguments are an object, not JSON text."""
        message: dict[str, Any] = {
            **(self.model_extra or {}),
            "role": "system" if self.role == "developer" else self.role,
            "content": self.content,
        }
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk
    include_obfuscation: Any = None


class _OpenAISampling(_Request):
    """Fields shared by chat completions and completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[int, float] | None = None  # JSON's keys are strings: "50256" is token 50256
    user: Any = None
    response_format: Any = None
    # vLLM's extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    min_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: Any = None
    prompt_logprobs: int | None = Field(default=None, ge=0)
    use_beam_search: Any = None
    length_penalty: Any = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    priority: Any = None
    logits_processors: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None

    _text = field_validator("model", "stop")(_unicode_strings)


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true, OpenAI's default
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    # vLLM's extensions.
    echo: Any = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template holds the special tokens already
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: Any = None

    def tool_request(self) -> ToolRequest:
        """tools, tool_choice and parallel_tool_calls."""
        choice = self.tool_choice
        return ToolRequest(
            [tool.function.model_dump(exclude_none=True) for tool in self.tools or ()],
            ToolChoice("named", choice.function.name)
            if isinstance(choice, NamedToolChoice)
            else ToolChoice(choice or "auto"),
            self.parallel_tool_calls is not False,
        )


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: Any = None
    add_special_tokens: bool = True  # vLLM's: False encodes a text prompt without BOS

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
    def _blocks(cls, content: str | list[Any]) -> str | list[dict]:
        """Text, or blocks: text, image, tool_use (in assistant turns), tool_result (in user
        turns)."""
        if isinstance(content, str):
            return _unicode(content)
        return [
            _tool_block(block)
            if _is_tool_block(block)
            else _anthropic_image(block)
            if isinstance(block, dict) and block.get("type") == "image"
            else block
            for block in content
        ]

    @model_validator(mode="after")
    def _tool_blocks_fit_the_role(self) -> AnthropicMessage:
        kinds = {block["type"] for block in self._tool_blocks()}
        wrong = "tool_result" if self.role == "assistant" else "tool_use"
        if wrong in kinds:
            raise ValueError(f"a {self.role} message cannot hold a {wrong} block")
        if not isinstance(self.content, str):
            for block in filter(_is_thinking_block, self.content):
                _thinking_of(block, self.role)
            _parts_of(self._text_blocks())
        return self

    def _text_blocks(self) -> list[Any]:
        return [b for b in self.content if not (_is_tool_block(b) or _is_thinking_block(b))]

    def _tool_blocks(self) -> list[dict]:
        return [] if isinstance(self.content, str) else list(filter(_is_tool_block, self.content))

    def template_messages(self) -> list[dict[str, Any]]:
        """The turn as chat templates take it: tool_use blocks become the assistant's
        tool_calls, and each tool_result block a tool message ahead of the user's text."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = _parts_of(self._text_blocks())
        blocks = self._tool_blocks()
        if self.role == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            thinking = [
                _thinking_of(b, self.role) for b in filter(_is_thinking_block, self.content)
            ]
            if thinking:
                message["reasoning_content"] = "".join(thinking)
            if blocks:
                message["tool_calls"] = [
                    {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": block["name"], "arguments": block["input"]},
                    }
                    for block in blocks
                ]
            return [message]
        results = [
            {"role": "tool", "tool_call_id": block["tool_use_id"], "content": block["content"]}
            for block in blocks
        ]
        return results + ([{"role": "user", "content": text}] if text or not results else [])


def _is_thinking_block(block: Any) -> bool:
    return isinstance(block, dict) and block.get("type") == "thinking"


def _thinking_of(block: dict, role: str) -> str:
    """A thinking block's text, which the chat template gets as the turn's reasoning_content;
    its signature is accepted unchecked (astrai signs nothing)."""
    if role != "assistant":
        raise ValueError("only an assistant message may hold a thinking block")
    unknown = sorted(key for key in block if key not in ("type", "thinking", "signature"))
    if unknown:
        raise ValueError(f"a thinking block's {unknown[0]!r} is not supported by astrai")
    if not isinstance(block.get("thinking"), str):
        raise ValueError("a thinking block needs a string 'thinking'")
    return _unicode(block["thinking"])


def _is_tool_block(block: Any) -> bool:
    return isinstance(block, dict) and block.get("type") in ("tool_use", "tool_result")


def _tool_block(block: dict) -> dict:
    """A tool_use or tool_result block, checked, with a result's content as its text."""
    keys = {
        "tool_use": {"id", "name", "input"},
        "tool_result": {"tool_use_id", "content", "is_error"},
    }
    allowed = keys[block["type"]] | {"type", "cache_control"}
    unknown = sorted(key for key, value in block.items() if key not in allowed and value)
    if unknown:
        raise ValueError(f"a {block['type']} block's {unknown[0]!r} is not supported by astrai")
    if block["type"] == "tool_use":
        if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)):
            raise ValueError("a tool_use block needs a string 'id' and 'name'")
        if not isinstance(block.get("input"), dict):
            raise ValueError("a tool_use block's 'input' must be an object")
        return {
            "type": "tool_use",
            "id": block["id"],
            "name": block["name"],
            "input": block["input"],
        }
    if not isinstance(block.get("tool_use_id"), str):
        raise ValueError("a tool_result block needs a string 'tool_use_id'")
    if block.get("is_error"):
        raise ValueError(
            "a tool_result block's is_error is not supported: chat templates have no error "
            "flag; say in its content that the tool failed"
        )
    content = block.get("content")
    text = content if isinstance(content, str) else _text_of(content)
    return {"type": "tool_result", "tool_use_id": block["tool_use_id"], "content": _unicode(text)}


class AnthropicTool(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: Any = None


class AnthropicToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_for_tool(self) -> AnthropicToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice of type 'tool' needs a name, and only it takes one")
        return self


class AnthropicThinking(_Request):
    """Extended thinking: enabled with a budget of tokens, adaptive (no budget), or disabled."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> AnthropicThinking:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError("thinking of type 'enabled' needs budget_tokens, and only it takes it")
        return self


class _AnthropicPrompt(_Request):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[Any] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    output_config: Any = None

    def tool_request(self) -> ToolRequest:
        """tools and tool_choice in OpenAI's terms, which chat templates and the parsers share:
        tools as function definitions, any and tool as forced calls."""
        choice = self.tool_choice
        modes = {None: "auto", "auto": "auto", "none": "none", "any": "required", "tool": "named"}
        # In the order of OpenAI's definitions, so the template renders both APIs' tools alike.
        functions = [
            {"name": t.name, "description": t.description, "parameters": t.input_schema}
            for t in self.tools or ()
        ]
        return ToolRequest(
            [{k: v for k, v in f.items() if v is not None} for f in functions],
            ToolChoice(modes[choice and choice.type], choice and choice.name),
            choice is None or not choice.disable_parallel_tool_use,
        )

    cache_control: Any = None
    speed: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None

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
    metadata: Any = None
    service_tier: Any = None
    container: Any = None
    context_management: Any = None
    mcp_servers: Any = None
    inference_geo: Any = None
    diagnostics: Any = None

    _stop_text = field_validator("stop_sequences")(_unicode_strings)


class CountTokensRequest(_AnthropicPrompt):
    pass


# Embeddings: OpenAI's and Ollama's


def _embedding_input(value: Any) -> Any:
    """An input of strings or token ids: the strings valid Unicode, and none of them empty."""
    if isinstance(value, list) and any(item in ("", []) for item in value):
        raise ValueError("an input must not be empty")
    if value == "":
        raise ValueError("the input must not be empty")
    return _unicode_strings(value)


class EmbeddingRequest(_Request):
    """POST /v1/embeddings: OpenAI's body, with vLLM's add_special_tokens and truncation."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: Any = None
    # vLLM's extensions.
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)

    _text = field_validator("model")(_unicode_strings)

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if value == []:
            raise ValueError("input must hold at least one text or token id")
        return _embedding_input(value)


class OllamaEmbedRequest(_Request):
    """POST /api/embed: Ollama's body."""

    model: str
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: int | None = Field(default=None, ge=1)
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None

    _text = field_validator("model", "input")(_unicode_strings)


class OllamaEmbeddingsRequest(_Request):
    """POST /api/embeddings: Ollama's older body, one prompt."""

    model: str
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None

    _text = field_validator("model", "prompt")(_unicode_strings)


# vLLM's tokenizer endpoints


class TokenizeRequest(_Request):
    """vLLM's /tokenize body: a completion prompt or chat messages, exactly one of them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    tools: list[ChatTool] | None = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None

    _text = field_validator("model", "prompt")(_unicode_strings)

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (a text) or 'messages' (a chat)")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# vLLM's LoRA adapter routes


class LoadLoraAdapterRequest(_Request):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(_Request):
    lora_name: str = Field(min_length=1, max_length=256)


# OpenAI Responses

# Keys of a Responses text part: input_text's, and what output_text carries when a client sends
# an earlier answer back (empty annotations and logprobs ask for nothing).
_RESPONSES_PART_KEYS = frozenset({"type", "text", "annotations", "logprobs"})


def _responses_text(content: Any, kinds: tuple[str, ...]) -> str:
    """The text of a Responses content: a string or a list of parts of the given kinds."""
    if isinstance(content, str):
        return _unicode(content)
    if not isinstance(content, list):
        raise ValueError(f"content must be a string or a list of {' or '.join(kinds)} parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds:
            raise ValueError(
                f"only {' and '.join(kinds)} content parts are supported (astrai takes text "
                f"only), got {kind!r}"
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f"a {kind} part needs a string 'text' field")
        unknown = sorted(k for k, v in part.items() if k not in _RESPONSES_PART_KEYS and v)
        if unknown:
            raise ValueError(f"a {kind} part's {unknown[0]!r} is not supported by astrai")
        texts.append(part["text"])
    return _unicode("".join(texts))


def _responses_image(part: dict) -> RequestImage:
    """A Responses input_image part's image, from its image_url (a data: URL)."""
    unknown = sorted(k for k, v in part.items() if k not in ("type", "image_url", "detail") and v)
    if unknown:
        raise ValueError(
            f"an input_image part's {unknown[0]!r} is not supported by astrai (it keeps no "
            "files); send image_url, a data: URL"
        )
    if not isinstance(part.get("image_url"), str):
        raise ValueError("an input_image part needs image_url, a data: URL")
    detail = part.get("detail") or "auto"
    return _openai_image(
        {"type": "image_url", "image_url": {"url": part["image_url"], "detail": detail}}
    )


class ResponsesMessage(_Request):
    """A message of a Responses input: OpenAI's easy input message, an input message, or an
    output message sent back."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Any]
    id: Any = None
    status: Any = None
    phase: Any = None

    @field_validator("content")
    @classmethod
    def _text_and_images(cls, content: str | list[Any]) -> str | list:
        """The text, or text pieces and images (input_image parts) in order."""
        kinds = ("input_text", "output_text")
        if not isinstance(content, list) or not any(
            isinstance(p, dict) and p.get("type") == "input_image" for p in content
        ):
            return _responses_text(content, kinds)
        return _parts_of(
            [
                _responses_image(p)
                if isinstance(p, dict) and p.get("type") == "input_image"
                else {"type": "text", "text": _responses_text([p], kinds)}
                for p in content
            ]
        )


class ResponsesFunctionCall(_Request):
    """A call the model made in an earlier answer, sent back with its output."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Any = None
    status: Any = None

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        if not isinstance(_json_or_none(arguments), dict):
            raise ValueError("a function_call's arguments must be a JSON object in a string")
        return arguments


class ResponsesFunctionCallOutput(_Request):
    """What a function call returned."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Any]
    id: Any = None
    status: Any = None

    @field_validator("output")
    @classmethod
    def _only_text(cls, output: str | list[Any]) -> str:
        return _responses_text(output, ("input_text",))


class ResponsesReasoning(_Request):
    """A reasoning item of an earlier answer, sent back: its text goes to the chat template as
    the next assistant message's reasoning_content."""

    type: Literal["reasoning"]
    summary: list[Any]
    content: list[Any] | None = None
    encrypted_content: str | None = None
    id: Any = None
    status: Any = None

    def text(self) -> str:
        """Its content, else its encrypted_content (which astrai writes as the plain text),
        else its summary."""
        if not self.content and self.encrypted_content is not None:
            return _unicode(self.encrypted_content)
        parts = self.content or self.summary
        kinds = ("reasoning_text",) if self.content else ("summary_text",)
        return _responses_text(parts, kinds)

    @model_validator(mode="after")
    def _text_parts(self) -> ResponsesReasoning:
        self.text()
        return self


def _item_type(item: Any) -> str:
    """An input item's type; a message may leave it out."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", "")


# Other items (hosted tools' calls, item references) are refused by the discriminator.
ResponsesItem = Annotated[
    Annotated[ResponsesMessage, Tag("message")]
    | Annotated[ResponsesFunctionCall, Tag("function_call")]
    | Annotated[ResponsesFunctionCallOutput, Tag("function_call_output")]
    | Annotated[ResponsesReasoning, Tag("reasoning")],
    Discriminator(
        _item_type,
        custom_error_type="unsupported_item",
        custom_error_message="astrai takes input items of type message, function_call, "
        "function_call_output and reasoning only",
    ),
]


class ResponsesFunctionTool(_Request):
    """A function tool, in the Responses API's flat shape."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: Any = None
    output_schema: Any = None
    allowed_callers: Any = None


class ResponsesNamedTool(_Request):
    type: Literal["function"]
    name: str


class ResponsesText(_Request):
    format: dict[str, Any] | None = None
    verbosity: Any = None

    @field_validator("format")
    @classmethod
    def _known_format(cls, format: dict[str, Any] | None) -> dict[str, Any] | None:
        if format is None:
            return None
        keys = {
            "text": {"type"},
            "json_object": {"type"},
            "json_schema": {"type", "name", "schema", "description", "strict"},
        }.get(format.get("type"))
        if keys is None:
            raise ValueError(
                f"format type {format.get('type')!r} is not supported; use text, json_object "
                "or json_schema"
            )
        unknown = sorted(set(format) - keys)
        if unknown:
            raise ValueError(f"format's {unknown[0]!r} is not supported by astrai")
        if format["type"] == "json_schema" and not isinstance(format.get("schema"), dict):
            raise ValueError("a json_schema format needs 'schema', the schema the output follows")
        return format


class ResponsesRequest(_Request):
    model: str | None = None
    input: list[ResponsesItem] = Field(min_length=1)
    instructions: str | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: bool | None = None  # None: true, OpenAI's default
    text: ResponsesText | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: Any = None
    store: bool | None = None  # None: true, OpenAI's default
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    reasoning: Any = None
    include: list[str] | None = None
    top_logprobs: Any = None
    truncation: Any = None
    max_tool_calls: Any = None
    client_metadata: Any = None  # the Codex CLI's
    user: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    service_tier: Any = None
    background: Any = None
    background_options: Any = None
    conversation: Any = None
    context_management: Any = None
    prompt: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None

    _text = field_validator("model", "instructions")(_unicode_strings)

    def tool_request(self) -> ToolRequest:
        """tools, tool_choice and parallel_tool_calls."""
        choice = self.tool_choice
        return ToolRequest(
            [
                tool.model_dump(
                    include={"name", "description", "parameters", "strict"}, exclude_none=True
                )
                for tool in self.tools or ()
            ],
            ToolChoice("named", choice.name)
            if isinstance(choice, ResponsesNamedTool)
            else ToolChoice(choice or "auto"),
            self.parallel_tool_calls is not False,
        )

    @field_validator("include")
    @classmethod
    def _includable(cls, include: list[str] | None) -> list[str] | None:
        other = sorted(set(include or ()) - {"reasoning.encrypted_content"})
        if other:
            raise ValueError(
                f"{other[0]!r} is not supported: astrai has no logprobs or hosted tools' extras "
                "to include; only reasoning.encrypted_content can be included"
            )
        return include

    @field_validator("input", mode="before")
    @classmethod
    def _text_is_a_user_message(cls, input: Any) -> Any:
        """A string input is one user message, as OpenAI reads it."""
        return [{"role": "user", "content": input}] if isinstance(input, str) else input


# Ollama


class OllamaOptions(_Request):
    """options of Ollama's /api/chat and /api/generate: its Modelfile parameters. astrai's own
    sampling defaults hold for those left out, as on its other APIs."""

    num_predict: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    num_ctx: int | None = Field(default=None, ge=1)
    num_keep: Any = None
    typical_p: Any = None
    repeat_last_n: Any = None
    tfs_z: Any = None
    mirostat: Any = None
    mirostat_tau: Any = None
    mirostat_eta: Any = None
    penalize_newline: Any = None
    numa: Any = None
    num_batch: Any = None
    num_gpu: Any = None
    main_gpu: Any = None
    low_vram: Any = None
    f16_kv: Any = None
    logits_all: Any = None
    vocab_only: Any = None
    use_mmap: Any = None
    use_mlock: Any = None
    embedding_only: Any = None
    num_thread: Any = None

    _text = field_validator("stop")(_unicode_strings)


class OllamaFunctionCall(_Request):
    name: str
    arguments: dict[str, Any]
    index: int | None = None  # the call's place in the message, as Ollama numbers them


class OllamaToolCall(_Request):
    """A call an assistant message made, as Ollama gives it: arguments are an object."""

    function: OllamaFunctionCall


def _ollama_images(images: list[str] | None) -> list[RequestImage] | None:
    """Ollama's images: base64 strings (no data: URL prefix)."""
    if images is None:
        return None
    return [_base64_image(image, f"images[{i}]") for i, image in enumerate(images)]


def _with_images(text: str, images: list[RequestImage] | None) -> str | list:
    """A message's content with Ollama's images: the images first, then the text."""
    return [*images, text] if images else text


class OllamaMessage(_Request):
    role: str
    content: str = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None

    _text = field_validator("role", "content", "thinking", "tool_name")(_unicode_strings)
    _images = field_validator("images")(_ollama_images)

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> OllamaMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message may carry tool_calls")
        if self.tool_name is not None and self.role != "tool":
            raise ValueError("only a tool message names the tool it answers (tool_name)")
        return self

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates take it, as transformers hands them: a tool message's
        tool_name is its name, an assistant's thinking its reasoning_content."""
        content = _with_images(self.content, self.images)
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.thinking is not None:
            message["reasoning_content"] = self.thinking
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_name is not None:
            message["name"] = self.tool_name
        return message


class _OllamaGeneration(_Request):
    """Fields /api/chat and /api/generate share."""

    model: str
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: OllamaOptions | None = None
    stream: bool = True  # Ollama streams unless told not to
    keep_alive: float | str | None = None
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    _text = field_validator("model")(_unicode_strings)


class OllamaChatRequest(_OllamaGeneration):
    messages: list[OllamaMessage] = Field(default_factory=list)  # none: load the model
    tools: list[ChatTool] | None = None

    def tool_request(self) -> ToolRequest:
        """tools, which Ollama lets the model call as it likes (OpenAI's auto)."""
        return ToolRequest(
            [tool.function.model_dump(exclude_none=True) for tool in self.tools or ()]
        )


class OllamaGenerateRequest(_OllamaGeneration):
    prompt: str | None = None  # none: load the model
    system: str | None = None
    raw: bool = False
    suffix: Any = None
    template: Any = None
    context: Any = None
    images: list[str] | None = None
    width: Any = None
    height: Any = None
    steps: Any = None

    _prompt_text = field_validator("prompt", "system")(_unicode_strings)
    _images = field_validator("images")(_ollama_images)

    def user_content(self) -> str | list:
        """The prompt as the user message's content, its images before it."""
        return _with_images(self.prompt, self.images)


class OllamaShowRequest(_Request):
    model: str | None = None
    name: str | None = None  # Ollama's older spelling of model
    verbose: Any = None

    @model_validator(mode="after")
    def _one_name(self) -> OllamaShowRequest:
        if (self.model is None) == (self.name is None):
            raise ValueError("give the model's name once, as 'model' (or Ollama's older 'name')")
        return self
