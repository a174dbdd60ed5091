"""OpenAI's Responses API: POST /v1/responses (streamed as typed events or not), and the
responses a server keeps in memory for previous_response_id and GET /v1/responses/{id}.

A request becomes a chat: instructions as the system message, then the stored conversation of
previous_response_id, then the input items (messages, function calls and their outputs); the
tools, tool_choice and output format go through the same paths as chat completions'. The answer
comes back as output items: a message, and a function_call item per call.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request

from astrai.inference import GenerationParams, TaskResult
from astrai.inference.constraints import Constraint, ConstraintError
from astrai.server.errors import APIError
from astrai.server.fields import refuse_unsupported
from astrai.server.generation import Generation, GenerationService
from astrai.server.protocol import (
    ResponsesFunctionCall,
    ResponsesFunctionCallOutput,
    ResponsesMessage,
    ResponsesReasoning,
    ResponsesRequest,
)
from astrai.server.reasoning import ReasoningStream
from astrai.server.registry import model_service
from astrai.server.sse import EventStreamResponse, sse_event
from astrai.server.tool_parsers import ToolCallDelta, ToolUse

router = APIRouter()

# How many stored responses a server keeps; the least recently used goes first.
STORED_RESPONSES = 1024


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


@dataclass
class _Stored:
    response: dict  # the response object as it was answered
    conversation: list[dict]  # its chat messages, input and output, without the instructions


class ResponseStore:
    """The responses a server keeps for previous_response_id and GET, least recently used
    dropped first once it holds `capacity`; one per app."""

    def __init__(self, capacity: int = STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._responses: OrderedDict[str, _Stored] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._responses[response["id"]] = _Stored(response, conversation)
        self._responses.move_to_end(response["id"])
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> _Stored:
        stored = self._responses.get(response_id)
        if stored is None:
            raise APIError(
                404,
                f"no stored response {response_id!r}: this server keeps the last "
                f"{self.capacity} responses created with store true, in memory, until it "
                "restarts; send the whole conversation as input instead",
                param=param,
                code="response_not_found",
            )
        self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._responses[response_id]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _conversation(items: list[Any]) -> list[dict]:
    """The input items as chat template messages: a function call joins the assistant message
    before it (or opens one), its output is a tool message, and a reasoning item's text is the
    next assistant message's reasoning_content (the item right after it; no other gets it)."""
    messages: list[dict] = []
    reasoning = None
    for item in items:
        if isinstance(item, ResponsesReasoning):
            reasoning = item.text()
            continue
        if isinstance(item, ResponsesFunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        elif isinstance(item, ResponsesMessage):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.content})
        elif isinstance(item, ResponsesFunctionCall):
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            call = {"name": item.name, "arguments": json.loads(item.arguments)}
            calls = messages[-1].setdefault("tool_calls", [])
            calls.append({"id": item.call_id, "type": "function", "function": call})
        if reasoning is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = reasoning
        reasoning = None
    return messages


async def _constraint(
    service: GenerationService, body: ResponsesRequest, tools: ToolUse
) -> Constraint | None:
    """The constraint of text.format or of the tools (not both), compiled off the event loop.

    A forced call's answer is the call alone, which text.format (the message's format) does not
    govern: agents send both, the format for the answer after the tool's output."""
    text_format = body.text.format if body.text is not None else None
    asked = []
    if tools.constraint is not None:
        asked.append(("tools", tools.constraint))
    if tools.forced:
        text_format = None
    if text_format is not None and text_format["type"] != "text":
        if text_format["type"] == "json_object":
            asked.append(("text.format", Constraint.json_object()))
        else:
            try:
                asked.append(("text.format", Constraint.json_schema(text_format["schema"])))
            except ConstraintError as exc:
                raise APIError(400, f"text.format: {exc}", param="text.format") from exc
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(
            400,
            "strict tools under tool_choice auto and text.format both constrain the answer, "
            "which astrai cannot combine yet; send strict false, or leave text.format out",
            param="text.format",
        )
    [(name, constraint)] = asked
    return await service.compiled(name, constraint)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    service, store = await model_service(request, body.model), _store(request)
    refuse_unsupported(body)
    earlier = []
    if body.previous_response_id is not None:
        earlier = store.get(body.previous_response_id, "previous_response_id").conversation
    conversation = earlier + _conversation(body.input)
    if not conversation:
        raise APIError(400, "input holds no message for the model to answer", param="input")
    tools = service.tool_use(body.tool_request())
    messages = conversation
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *conversation]
    prompt = await service.chat_prompt(messages, tools=tools.definitions)
    params = service.params(
        [prompt],
        body.max_output_tokens,
        body.model,
        temperature=body.temperature,
        top_p=body.top_p,
        constraint=await _constraint(service, body, tools),
    )
    generation = service.submit([prompt], params)
    parser = service.reasoning_parser
    opened = parser is not None and parser.opened_by(service.tokenizer, prompt)
    answer = _Answer(body, service, tools, conversation, store, opened, params)
    if body.stream:
        return EventStreamResponse(answer.events(generation))
    [output] = await generation.collect(request)
    return answer.whole(output.result)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict:
    return _store(request).get(response_id).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict:
    _store(request).delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@dataclass
class _Answer:
    """One response being answered: its object, its output items, and storing it."""

    body: ResponsesRequest
    service: GenerationService
    tools: ToolUse
    conversation: list[dict]
    store: ResponseStore
    opened: bool  # the prompt left a think block open for the answer to close
    params: GenerationParams
    id: str = field(default_factory=lambda: _new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        """The response object, with what it was asked for as OpenAI echoes it."""
        body = self.body
        choice = body.tool_choice or "auto"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.service.adapter_for(body.model) or self.service.model_name,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store is not False,
            "temperature": self.params.temperature,
            "text": {"format": (body.text and body.text.format) or {"type": "text"}},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [
                {
                    "description": None,
                    "parameters": None,
                    "strict": None,
                    **tool.model_dump(
                        include={"type", "name", "description", "parameters", "strict"}
                    ),
                }
                for tool in body.tools or ()
            ],
            "top_p": self.params.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": None,
            "metadata": body.metadata or {},
        }

    def encrypt(self, item: dict) -> None:
        """include reasoning.encrypted_content: a reasoning item carries its text for a client
        that keeps no state to send back; astrai keeps it plain, not encrypted."""
        if item["type"] == "reasoning" and "reasoning.encrypted_content" in (
            self.body.include or ()
        ):
            item["encrypted_content"] = item["content"][0]["text"]

    def finish(self, result: TaskResult, output: list[dict]) -> dict:
        """The final response object, stored unless store is false."""
        status = "incomplete" if result.finish_reason == "length" else "completed"
        parser, reasoning_tokens = self.service.reasoning_parser, 0
        if parser is not None:
            tokenizer = self.service.tokenizer
            reasoning_tokens = parser.reasoning_tokens(tokenizer, result.token_ids, self.opened)
        usage = {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.cached_tokens},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        }
        response = self.response(status, output, usage)
        if self.body.store is not False:
            self.store.put(response, self.conversation + [_assistant_message(output)])
        return response

    def whole(self, result: TaskResult) -> dict:
        """The answer of a request that does not stream."""
        parser, text, calls, output = self.service.reasoning_parser, result.text, [], []
        if parser is not None:
            reasoning, text = parser.split(text, self.opened)
            if reasoning is not None:
                output.append(_reasoning_item([_PARTS["reasoning"](reasoning)]))
                self.encrypt(output[-1])
        if self.tools.parser is not None:
            content, calls = self.tools.parser.parse(text)
            if calls:
                text = content
                calls = calls if self.tools.parallel else calls[:1]
        if text and not self.tools.forced:
            output.append(_message_item([_text_part(text)]))
        for call in calls:
            output.append({**_call_item(call.name), "arguments": call.arguments})
        # As streamed: every item done before the last, which ends as the response does.
        if output and result.finish_reason == "length":
            output[-1]["status"] = "incomplete"
        return self.finish(result, output)

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        """The typed events of a streamed answer, each with its sequence number."""
        parser = self.service.reasoning_parser
        items = _StreamedItems(self.tools, parser and parser.stream(self.opened), self.encrypt)
        number = 0

        def event(kind: str, data: dict) -> str:
            nonlocal number
            number += 1
            return sse_event(kind, {**data, "sequence_number": number - 1})

        opening = self.response("in_progress", [])
        yield event("response.created", {"response": opening})
        yield event("response.in_progress", {"response": opening})
        async with aclosing(generation.events()) as engine_events:
            async for engine_event in engine_events:
                if engine_event.delta is not None:
                    for kind, data in items.feed(engine_event.delta.text):
                        yield event(kind, data)
                result = engine_event.result
                if result is None:
                    continue
                try:
                    generation.check(result)
                except APIError as exc:
                    failed = self.response("failed", items.output)
                    failed["error"] = {"code": "server_error", "message": exc.message}
                    yield event("response.failed", {"response": failed})
                    return
                status = "incomplete" if result.finish_reason == "length" else "completed"
                for kind, data in items.finish(status):
                    yield event(kind, data)
                response = self.finish(result, items.output)
                yield event(f"response.{status}", {"response": response})


def _message_item(content: list[dict], status: str = "completed") -> dict:
    item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": status}
    return {**item, "content": content}


def _reasoning_item(content: list[dict], status: str = "completed") -> dict:
    item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": content}
    return {**item, "status": status}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(name: str, status: str = "completed") -> dict:
    item = {"id": _new_id("fc"), "type": "function_call", "status": status}
    return {**item, "call_id": _new_id("call"), "name": name, "arguments": ""}


# Per kind of item with text: its new item, its text part, its delta and done events.
_ITEMS = {"message": _message_item, "reasoning": _reasoning_item}
_PARTS = {"message": _text_part, "reasoning": lambda text: {"type": "reasoning_text", "text": text}}
_TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


def _assistant_message(output: list[dict]) -> dict:
    """The output items as the assistant message a later request's chat holds."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "message":
            message["content"] = item["content"][0]["text"]
        elif item["type"] == "reasoning":
            message["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "function_call":
            call = {"name": item["name"], "arguments": json.loads(item["arguments"])}
            message.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": call}
            )
    return message


class _StreamedItems:
    """A streamed answer's output items and the events that build them: a reasoning item's text
    as reasoning_text deltas, a message's as output_text deltas, then each call's arguments as
    function_call_arguments deltas; an item is done before the next is added."""

    def __init__(
        self,
        tools: ToolUse,
        reasoning: ReasoningStream | None = None,
        finish_item: Callable[[dict], None] = lambda item: None,
    ) -> None:
        """finish_item completes an item before it is done (encrypted_content)."""
        self._stream = None if tools.parser is None else tools.parser.stream()
        self._reasoning = reasoning
        self._finish_item = finish_item
        self._forced = tools.forced
        self._parallel = tools.parallel
        self.output: list[dict] = []
        self._open: dict | None = None

    def feed(self, text: str) -> list[tuple[str, dict]]:
        if self._reasoning is None:
            return self._answer(text)
        reasoning, text = self._reasoning.feed(text)
        return self._text("reasoning", reasoning) + self._answer(text)

    def finish(self, status: str) -> list[tuple[str, dict]]:
        events = []
        if self._reasoning is not None:
            reasoning, text = self._reasoning.finish()
            events = self._text("reasoning", reasoning) + self._answer(text)
        if self._stream is not None:
            events += self._text("message", self._stream.finish())
        return events + self._close(status)

    def _answer(self, text: str) -> list[tuple[str, dict]]:
        if self._stream is None:
            return self._text("message", text)
        content, calls = self._stream.feed(text)
        return self._text("message", content) + self._calls(calls)

    def _text(self, kind: str, text: str) -> list[tuple[str, dict]]:
        """Text of a message or reasoning item, the item and its part added first."""
        if not text or (kind == "message" and self._forced):
            return []
        events = []
        if self._open is None or self._open["type"] != kind:
            events = self._close("completed") + self._add(_ITEMS[kind]([], "in_progress"))
            self._open["content"].append(_PARTS[kind](""))
            events.append(self._event("response.content_part.added", part=_PARTS[kind]("")))
        self._open["content"][0]["text"] += text
        events.append(self._event(f"{_TEXT_EVENTS[kind]}.delta", delta=text))
        return events

    def _calls(self, calls: list[ToolCallDelta]) -> list[tuple[str, dict]]:
        events = []
        for call in calls:
            if call.index > 0 and not self._parallel:
                continue
            if call.name is not None:
                events += self._close("completed") + self._add(_call_item(call.name, "in_progress"))
            if call.arguments:
                self._open["arguments"] += call.arguments
                kind = "response.function_call_arguments.delta"
                events.append(self._event(kind, delta=call.arguments))
        return events

    def _event(self, kind: str, **data: Any) -> tuple[str, dict]:
        """An event about the open item, as it is now (later deltas do not change it)."""
        where = {"output_index": len(self.output) - 1}
        if kind != "response.output_item.added" and kind != "response.output_item.done":
            where["item_id"] = self._open["id"]
            if self._open["type"] in _ITEMS:
                where["content_index"] = 0
        return kind, copy.deepcopy({**where, **data})

    def _add(self, item: dict) -> list[tuple[str, dict]]:
        self.output.append(item)
        self._open = item
        return [self._event("response.output_item.added", item=item)]

    def _close(self, status: str) -> list[tuple[str, dict]]:
        item = self._open
        if item is None:
            return []
        if item["type"] in _ITEMS:
            part = item["content"][0]
            events = [self._event(f"{_TEXT_EVENTS[item['type']]}.done", text=part["text"])]
            events.append(self._event("response.content_part.done", part=part))
        else:
            kind = "response.function_call_arguments.done"
            events = [self._event(kind, name=item["name"], arguments=item["arguments"])]
        item["status"] = status
        self._finish_item(item)
        events.append(self._event("response.output_item.done", item=item))
        self._open = None
        return events
