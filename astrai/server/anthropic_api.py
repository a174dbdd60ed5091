"""Anthropic-compatible endpoints: messages (streamed or not) and token counting."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request

from astrai.inference import TaskResult
from astrai.server.errors import APIError, anthropic_error_body
from astrai.server.fields import refuse_unsupported
from astrai.server.generation import Generation, GenerationService
from astrai.server.protocol import CountTokensRequest, MessagesRequest
from astrai.server.sse import EventStreamResponse, sse_event

router = APIRouter()


def _service(request: Request) -> GenerationService:
    return request.app.state.service


async def _prompt(
    service: GenerationService, body: MessagesRequest | CountTokensRequest
) -> list[int]:
    messages = [{"role": m.role, "content": m.content} for m in body.messages]
    if body.system:
        messages.insert(0, {"role": "system", "content": body.system})
    return await service.chat_prompt(messages)


def _stop(result: TaskResult) -> dict:
    """stop_reason and stop_sequence: a matched stop string, the length limit, or end of turn."""
    if result.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
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
    service = _service(request)
    service.check_model(body.model)
    refuse_unsupported(body)
    return {"input_tokens": len(await _prompt(service, body))}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    service = _service(request)
    service.check_model(body.model)
    refuse_unsupported(body)
    # Anthropic's temperature range is narrower than the engine's.
    if body.temperature is not None and body.temperature > 1:
        raise APIError(
            400,
            f"temperature must be between 0 and 1 in the Messages API, got {body.temperature}",
            param="temperature",
        )
    prompt = await _prompt(service, body)
    params = service.params(
        [prompt],
        body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop_sequences or (),
    )
    generation = service.submit([prompt], params)
    message = {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": service.model_name,
    }
    if body.stream:
        return EventStreamResponse(_message_events(generation, message, len(prompt)))
    outputs = await generation.collect(request)
    result = outputs[0].result
    usage = _input_usage(result.prompt_tokens, result.cached_tokens)
    return {
        **message,
        "content": [{"type": "text", "text": result.text}],
        **_stop(result),
        "usage": {**usage, "output_tokens": result.completion_tokens},
    }


async def _message_events(
    generation: Generation, message: dict, prompt_tokens: int
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
                block = {"type": "text", "text": ""}
                yield sse_event("content_block_start", {"index": 0, "content_block": block})
                yield sse_event("ping", {})
            if event.delta is not None and event.delta.text:
                delta = {"type": "text_delta", "text": event.delta.text}
                yield sse_event("content_block_delta", {"index": 0, "delta": delta})
            if event.result is None:
                continue
            result = event.result
            try:
                generation.check(result)
            except APIError as exc:
                error = anthropic_error_body(exc.status, exc.message)["error"]
                yield sse_event("error", {"error": error})
                return
            yield sse_event("content_block_stop", {"index": 0})
            usage = _input_usage(result.prompt_tokens, result.cached_tokens)
            usage["output_tokens"] = result.completion_tokens
            yield sse_event("message_delta", {"delta": _stop(result), "usage": usage})
            yield sse_event("message_stop", {})
