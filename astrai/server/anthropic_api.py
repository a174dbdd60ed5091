"""Anthropic-compatible endpoints: messages (streamed or not) and token counting."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request

from astrai.inference import TaskResult
from astrai.inference.constraints import ConstraintError
from astrai.inference.task import ThinkingBudget
from astrai.server.errors import APIError, anthropic_error_body
from astrai.server.fields import refuse_unsupported
from astrai.server.generation import Generation, GenerationService
from astrai.server.protocol import CountTokensRequest, MessagesRequest
from astrai.server.reasoning import ReasoningStream
from astrai.server.registry import model_service
from astrai.server.sse import EventStreamResponse, sse_event
from astrai.server.tool_parsers import ToolCallDelta, ToolUse

router = APIRouter()


async def _prompt(
    service: GenerationService, body: MessagesRequest | CountTokensRequest, tools: ToolUse
) -> list[int]:
    """The chat's prompt; a last assistant message is a prefill that the answer continues."""
    messages = [message for m in body.messages for message in m.template_messages()]
    if body.system:
        messages.insert(0, {"role": "system", "content": body.system})
    prefill = body.messages[-1].role == "assistant"
    return await service.chat_prompt(
        messages,
        tools=tools.definitions,
        continue_final_message=prefill,
        template_kwargs=_thinking_kwargs(service, body),
    )


def _thinking_kwargs(
    service: GenerationService, body: MessagesRequest | CountTokensRequest
) -> dict | None:
    """thinking as the chat template's enable_thinking (Qwen3's switch), when it is given;
    thinking needs a reasoning model."""
    if body.thinking is None:
        return None
    enabled = body.thinking.type != "disabled"
    if enabled and service.reasoning_parser is None:
        raise APIError(
            400,
            "thinking needs a model that thinks in a format astrai reads, and this model's chat "
            "template shows none; start astrai serve with --reasoning-parser think, or leave "
            "thinking out",
            param="thinking",
        )
    return {"enable_thinking": enabled}


def _thinking_budget(service: GenerationService, body: MessagesRequest, tools: ToolUse) -> dict:
    """The GenerationParams that end thinking once budget_tokens are spent."""
    if body.thinking is None or body.thinking.budget_tokens is None:
        return {}
    budget = body.thinking.budget_tokens
    if budget >= body.max_tokens:
        raise APIError(
            400,
            f"thinking.budget_tokens ({budget}) must be less than max_tokens "
            f"({body.max_tokens}), which counts the thinking too",
            param="thinking.budget_tokens",
        )
    if tools.constraint is not None:
        raise APIError(
            400,
            "thinking cannot be combined with tool_choice any or tool, which force a call at "
            "once; use tool_choice auto",
            param="thinking",
        )
    end_ids = service.tokenizer.encode(service.reasoning_parser.end, add_special_tokens=False)
    return {"thinking_budget": ThinkingBudget(budget, tuple(end_ids))}


async def _compile(service: GenerationService, tools: ToolUse) -> None:
    """Compile the tools' grammar off the event loop; one that fails is a 400."""
    if tools.constraint is None:
        return
    try:
        await asyncio.to_thread(service.engine.compile, tools.constraint)
    except ConstraintError as exc:
        raise APIError(400, f"tools: {exc}", param="tools") from exc


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _content(text: str, tools: ToolUse, reasoning: str | None) -> tuple[list[dict], bool]:
    """The answer's content blocks (after a thinking block with the reasoning, when there is
    one), and whether it calls tools."""
    blocks, called = _answer_blocks(text, tools)
    if reasoning is None:
        return blocks, called
    # An answer cut off while thinking is its thinking block alone, as Anthropic's.
    blocks = [block for block in blocks if block != {"type": "text", "text": ""}]
    return [{"type": "thinking", "thinking": reasoning, "signature": ""}, *blocks], called


def _answer_blocks(text: str, tools: ToolUse) -> tuple[list[dict], bool]:
    if tools.parser is not None:
        before, calls = tools.parser.parse(text)
        if calls:
            calls = calls if tools.parallel else calls[:1]
            blocks = [{"type": "text", "text": before}] if before else []
            for call in calls:
                block = {"type": "tool_use", "id": _tool_use_id(), "name": call.name}
                blocks.append({**block, "input": json.loads(call.arguments)})
            return blocks, True
    return [{"type": "text", "text": "" if tools.forced else text}], False


def _stop(result: TaskResult, called: bool = False) -> dict:
    """stop_reason and stop_sequence: the length limit (even after complete calls), a tool
    call, a matched stop string, or end of turn."""
    if result.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if called:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(result.stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": result.stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _input_usage(prompt_tokens: int, cached_tokens: int) -> dict:
    # Anthropic counts prefix-cache reads apart from the input tokens that were computed.
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
    }


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    service = await model_service(request, body.model)
    refuse_unsupported(body)
    return {
        "input_tokens": len(await _prompt(service, body, service.tool_use(body.tool_request())))
    }


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    service = await model_service(request, body.model)
    refuse_unsupported(body)
    # Anthropic's temperature range is narrower than the engine's.
    if body.temperature is not None and body.temperature > 1:
        raise APIError(
            400,
            f"temperature must be between 0 and 1 in the Messages API, got {body.temperature}",
            param="temperature",
        )
    tools = service.tool_use(body.tool_request())
    prompt = await _prompt(service, body, tools)
    await _compile(service, tools)
    params = service.params(
        [prompt],
        body.max_tokens,
        body.model,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop_sequences or (),
        constraint=tools.constraint,
        **_thinking_budget(service, body, tools),
    )
    generation = service.submit([prompt], params)
    message = {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": params.lora or service.model_name,
    }
    parser = service.reasoning_parser
    opened = parser is not None and parser.opened_by(service.tokenizer, prompt)
    if body.stream:
        reasoning = parser and parser.stream(opened)
        blocks = _StreamedBlocks(tools, reasoning)
        return EventStreamResponse(_message_events(generation, message, len(prompt), blocks))
    outputs = await generation.collect(request)
    result = outputs[0].result
    usage = _input_usage(result.prompt_tokens, result.cached_tokens)
    reasoning, text = (None, result.text) if parser is None else parser.split(result.text, opened)
    content, called = _content(text, tools, reasoning)
    return {
        **message,
        "content": content,
        **_stop(result, called),
        "usage": {**usage, "output_tokens": result.completion_tokens},
    }


async def _message_events(
    generation: Generation, message: dict, prompt_tokens: int, blocks: _StreamedBlocks
) -> AsyncIterator[str]:
    # message_start waits for the first engine event: only then is it known how much of the
    # prompt the prefix cache served, so its input usage equals the final one.
    opened = False
    async with aclosing(generation.events()) as events:
        async for event in events:
            if not opened:
                opened = True
                cached = (event.result or event.delta).cached_tokens
                usage = {**_input_usage(prompt_tokens, cached), "output_tokens": 0}
                started = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
                yield sse_event("message_start", {"message": {**started, "usage": usage}})
                for frame in blocks.opening():
                    yield frame
                yield sse_event("ping", {})
            if event.delta is not None:
                for frame in blocks.feed(event.delta.text):
                    yield frame
            if event.result is None:
                continue
            result = event.result
            try:
                generation.check(result)
            except APIError as exc:
                error = anthropic_error_body(exc.status, exc.message)["error"]
                yield sse_event("error", {"error": error})
                return
            for frame in blocks.finish():
                yield frame
            usage = _input_usage(result.prompt_tokens, result.cached_tokens)
            usage["output_tokens"] = result.completion_tokens
            delta = _stop(result, blocks.called)
            yield sse_event("message_delta", {"delta": delta, "usage": usage})
            yield sse_event("message_stop", {})


class _StreamedBlocks:
    """One answer's content blocks as Anthropic streams them: text, then tool_use blocks (each
    started with an empty input, its arguments then sent as input_json_delta fragments), every
    block stopped before the next starts. A thinking block, with its thinking_delta fragments,
    comes first."""

    def __init__(self, tools: ToolUse, reasoning: ReasoningStream | None = None) -> None:
        self._stream = None if tools.parser is None else tools.parser.stream()
        self._reasoning = reasoning
        self._parallel = tools.parallel
        self._forced = tools.forced
        self._index = -1  # the open block's, or the last one's
        self._open: str | None = None  # the open block's type
        self.called = False

    def opening(self) -> list[str]:
        """Without tools or thinking the text block opens at once, before any text."""
        if self._stream is None and self._reasoning is None:
            return self._start({"type": "text", "text": ""})
        return []

    def feed(self, text: str) -> list[str]:
        if self._reasoning is None:
            return self._answer(text)
        thinking, text = self._reasoning.feed(text)
        return self._thinking(thinking) + self._answer(text)

    def finish(self) -> list[str]:
        frames = []
        if self._reasoning is not None:
            thinking, text = self._reasoning.finish()
            frames = self._thinking(thinking) + self._answer(text)
        if self._stream is not None:
            frames += self._text(self._stream.finish())
        if self._index < 0:  # an empty answer is one empty text block
            frames += self._start({"type": "text", "text": ""})
        return frames + self._stop()

    def _answer(self, text: str) -> list[str]:
        if self._stream is None:
            return self._text(text)
        content, calls = self._stream.feed(text)
        return self._text(content) + self._calls(calls)

    def _thinking(self, text: str) -> list[str]:
        if not text:
            return []
        frames = []
        if self._open != "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
            frames = self._stop() + self._start(block)
        delta = {"type": "thinking_delta", "thinking": text}
        return frames + [sse_event("content_block_delta", {"index": self._index, "delta": delta})]

    def _text(self, text: str) -> list[str]:
        if not text or self._forced:
            return []
        frames = (
            [] if self._open == "text" else self._stop() + self._start({"type": "text", "text": ""})
        )
        delta = {"type": "text_delta", "text": text}
        return frames + [sse_event("content_block_delta", {"index": self._index, "delta": delta})]

    def _calls(self, calls: list[ToolCallDelta]) -> list[str]:
        frames = []
        for call in calls:
            if call.index > 0 and not self._parallel:
                continue
            if call.name is not None:
                self.called = True
                block = {"type": "tool_use", "id": _tool_use_id(), "name": call.name, "input": {}}
                frames += self._stop() + self._start(block)
            if call.arguments:
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                frames.append(
                    sse_event("content_block_delta", {"index": self._index, "delta": delta})
                )
        return frames

    def _start(self, block: dict) -> list[str]:
        self._index += 1
        self._open = block["type"]
        return [sse_event("content_block_start", {"index": self._index, "content_block": block})]

    def _stop(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [sse_event("content_block_stop", {"index": self._index})]
