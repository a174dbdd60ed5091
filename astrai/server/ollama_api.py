"""Ollama-compatible endpoints: chat and generate (NDJSON streams ending in Ollama's final record,
or one object), the model list and its facts, the running model, the version.

Ollama's clients (its Python and JavaScript libraries, Open WebUI, editors' local-model modes)
find a served model under its name or name:latest. A request's keep_alive says how long its
model stays loaded after it, as Ollama's does (0: unloaded once answered; negative: for ever; left
out: --idle-unload); a server of one model keeps it loaded, and refuses a time (a 400).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute

from astrai.inference import TaskResult, TokenLogprob
from astrai.inference.constraints import Constraint, ConstraintError
from astrai.server.errors import APIError
from astrai.server.fields import refuse_unsupported
from astrai.server.generation import Generation, GenerationService
from astrai.server.logprobs import chat_logprobs
from astrai.server.protocol import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaOptions,
    OllamaShowRequest,
)
from astrai.server.reasoning import ReasoningStream
from astrai.server.registry import ModelRegistry, ServedModel, model_service
from astrai.server.sse import NDJSONResponse, ndjson_line
from astrai.server.tool_parsers import ToolCallStream, ToolUse


class JSONBodyRoute(APIRoute):
    """A route that reads its body as JSON whatever its Content-Type says, as Ollama does: its
    own curl examples send none, so curl sends its form default."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def handle(request: Request):
            headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
            scope = {**request.scope, "headers": [*headers, (b"content-type", b"application/json")]}
            return await handler(Request(scope, request.receive))

        return handle


router = APIRouter(route_class=JSONBodyRoute)

# The Ollama release whose API this follows (thinking, tool_name, capabilities): clients compare
# /api/version with the release a feature came in. astrai's own version is at /version.
OLLAMA_VERSION = "0.12.0"

# A model loaded for as long as the server runs has no expiry; Ollama gives a far date then.
NEVER = "9999-12-31T23:59:59Z"

# Ollama's durations: a number of seconds, or Go's duration text ("5m", "1h30m", "-1s").
_DURATION = re.compile(
    r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|ms|s|m|h))+|[+-]?(?:\d+\.?\d*|\.\d+)"
)
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def ollama_name(name: str | None) -> str | None:
    """The served name of a model (or LoRA adapter) as Ollama names it: with a tag, latest
    when left out; a served model answers to both."""
    if name is not None and name.endswith(":latest"):
        return name.removesuffix(":latest")
    return name


def keep_alive_seconds(keep_alive: float | str | None) -> float | None:
    """The seconds a keep_alive keeps its model loaded after the request: math.inf for a
    negative one (for ever), None for none given (the server's --idle-unload)."""
    if keep_alive is None:
        return None
    if isinstance(keep_alive, str):
        if not _DURATION.fullmatch(keep_alive):
            raise APIError(
                400,
                f"keep_alive {keep_alive!r} is no duration; send seconds or text such as '5m'",
                param="keep_alive",
            )
        parts = _DURATION_PART.findall(keep_alive)
        seconds = sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
        if not parts:
            seconds = abs(float(keep_alive))
        if keep_alive.startswith("-"):
            seconds = -seconds
    else:
        seconds = float(keep_alive)
    return math.inf if seconds < 0 else seconds


def _thinking(service: GenerationService, think: bool | str | None) -> dict | None:
    """think as the chat template's enable_thinking (Qwen3's switch); thinking needs a reasoning
    model, and effort levels are passed to none."""
    if think is None:
        return None
    if isinstance(think, str):
        raise APIError(
            400,
            f"think {think!r} asks for a level of effort, which astrai passes to no model; send "
            "true or false",
            param="think",
        )
    if think and service.reasoning_parser is None:
        raise APIError(
            400,
            "think needs a model that thinks in a format astrai reads, and this model's chat "
            "template shows none; start astrai serve with --reasoning-parser think, or leave "
            "think out",
            param="think",
        )
    return {"enable_thinking": think}


def _sampling(options: OllamaOptions | None) -> dict:
    """The options' sampling settings as GenerationParams keywords; top_k 0 or less is off."""
    if options is None:
        return {}
    stop = [options.stop] if isinstance(options.stop, str) else options.stop
    return {
        "temperature": options.temperature,
        "top_k": None if options.top_k is None else max(options.top_k, 0),
        "top_p": options.top_p,
        "min_p": options.min_p,
        "repetition_penalty": options.repeat_penalty,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
        "seed": options.seed,
        "stop": stop,
    }


def _max_tokens(
    service: GenerationService, prompt: list[int], options: OllamaOptions | None
) -> int | None:
    """num_predict (-1, no limit, and -2, fill the context: to the end of the context), held
    within num_ctx when it is given; num_ctx past the server's context is a 400, as is a
    prompt and num_predict that do not fit in it (Ollama would shift the context)."""
    num_predict = None if options is None else options.num_predict
    if num_predict == 0 or (num_predict is not None and num_predict < -2):
        raise APIError(
            400,
            f"options.num_predict must be positive, or -1 (no limit) or -2 (fill the context), "
            f"got {num_predict}",
            param="options.num_predict",
        )
    if num_predict is not None and num_predict < 0:
        num_predict = None
    num_ctx = None if options is None else options.num_ctx
    if num_ctx is None:
        return num_predict
    context = service.engine.max_seq_len
    if num_ctx > context:
        raise APIError(
            400,
            f"options.num_ctx {num_ctx} is more than this server's context of {context} tokens "
            "(astrai serve --max-seq-len sets it); ask for at most that, or leave num_ctx out",
            param="options.num_ctx",
        )
    room = num_ctx - len(prompt)
    if room < 1 or (num_predict is not None and num_predict > room):
        wanted = "at least one token" if num_predict is None else f"num_predict {num_predict}"
        raise APIError(
            400,
            f"the prompt ({len(prompt)} tokens) and {wanted} do not fit in options.num_ctx "
            f"{num_ctx}; raise num_ctx or shorten the request (astrai never cuts a prompt)",
            param="options.num_ctx",
        )
    return room if num_predict is None else num_predict


async def _constraint(
    service: GenerationService, format: str | dict | None, tools: ToolUse
) -> Constraint | None:
    """format ("json": any JSON object; a JSON schema) as an output constraint, compiled; a bad
    schema, or one beside strict tools' grammar, is a 400."""
    if format in (None, ""):
        return tools.constraint
    if tools.constraint is not None:
        raise APIError(
            400, "format and strict tools both constrain the output; give one", param="format"
        )
    try:
        constraint = (
            Constraint.json_object() if format == "json" else Constraint.json_schema(format)
        )
    except ConstraintError as exc:
        raise APIError(400, f"format: {exc}", param="format") from exc
    return await service.compiled("format", constraint)


@dataclass(frozen=True)
class _Arrival:
    """When a request came and when its model was ready for it (perf_counter): when it came if
    the model was loaded, else once it had loaded."""

    received: float
    ready: float


def _metrics(generation: Generation, result: TaskResult, arrival: _Arrival) -> dict:
    """Ollama's final counts and durations in nanoseconds: the model's load, the prompt's
    evaluation until the first token, the rest is generation."""
    end = generation.end_time or time.perf_counter()
    first = generation.first_token_time or end
    return {
        "total_duration": int((end - arrival.received) * 1e9),
        "load_duration": int((arrival.ready - arrival.received) * 1e9),
        "prompt_eval_count": result.prompt_tokens,
        "prompt_eval_duration": int((first - generation.arrival) * 1e9),
        "eval_count": result.completion_tokens,
        "eval_duration": int((end - first) * 1e9),
    }


def _done(result: TaskResult) -> dict:
    return {"done": True, "done_reason": result.finish_reason}


def _tool_call(index: int, name: str, arguments: str) -> dict:
    return {"function": {"index": index, "name": name, "arguments": json.loads(arguments)}}


class _StreamedMessage:
    """One answer's text as Ollama's message pieces: thinking, content, and each tool call
    whole (with its arguments as an object) once it is complete."""

    def __init__(self, tools: ToolUse, reasoning: ReasoningStream | None) -> None:
        self._calls: ToolCallStream | None = None if tools.parser is None else tools.parser.stream()
        self._reasoning = reasoning
        self._names: dict[int, str] = {}

    def feed(self, text: str) -> list[dict]:
        if self._reasoning is None:
            return self._answer(text)
        thinking, text = self._reasoning.feed(text)
        return self._thought(thinking) + self._answer(text)

    def finish(self) -> list[dict]:
        pieces = []
        if self._reasoning is not None:
            thinking, text = self._reasoning.finish()
            pieces = self._thought(thinking) + self._answer(text)
        if self._calls is not None:
            pieces += self._content(self._calls.finish())
        return pieces

    def _thought(self, thinking: str) -> list[dict]:
        return [{"role": "assistant", "content": "", "thinking": thinking}] if thinking else []

    def _content(self, text: str) -> list[dict]:
        return [{"role": "assistant", "content": text}] if text else []

    def _answer(self, text: str) -> list[dict]:
        if self._calls is None:
            return self._content(text)
        content, deltas = self._calls.feed(text)
        pieces = self._content(content)
        for delta in deltas:  # a call's name, then its whole arguments
            if delta.name is not None:
                self._names[delta.index] = delta.name
            if delta.arguments:
                call = _tool_call(delta.index, self._names[delta.index], delta.arguments)
                pieces.append({"role": "assistant", "content": "", "tool_calls": [call]})
        return pieces


def _whole_message(
    service: GenerationService, text: str, tools: ToolUse, opened: bool
) -> dict[str, Any]:
    """The assistant message of a whole answer: its thinking, content and tool calls."""
    message: dict[str, Any] = {"role": "assistant"}
    if service.reasoning_parser is not None:
        thinking, text = service.reasoning_parser.split(text, opened)
        if thinking is not None:
            message["thinking"] = thinking
    calls = []
    if tools.parser is not None:
        content, calls = tools.parser.parse(text)
        if calls:
            text = content
    message["content"] = text
    if calls:
        message["tool_calls"] = [_tool_call(i, c.name, c.arguments) for i, c in enumerate(calls)]
    return message


def _logprobs(body: OllamaChatRequest | OllamaGenerateRequest) -> int | None:
    """logprobs and top_logprobs as GenerationParams.logprobs: None (off), or how many of the
    likeliest tokens each token comes with."""
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _token_logprobs(service: GenerationService, entries: Sequence[TokenLogprob]) -> list[dict]:
    """Ollama's logprobs: each token's text, logprob and bytes, with its top_logprobs."""
    return chat_logprobs(service.tokenizer, entries)["content"]


async def _records(
    service: GenerationService,
    generation: Generation,
    head: dict,
    pieces: _StreamedMessage,
    render: Callable[[dict], dict],
    arrival: _Arrival,
    logprobs: bool,
) -> AsyncIterator[str]:
    """The NDJSON lines of a streamed answer: one per piece (a token's logprobs on the first
    piece of its text, or on an empty one), then the final record (with an empty piece), or an
    error line."""
    empty = {"role": "assistant", "content": ""}
    async with aclosing(generation.events()) as events:
        async for event in events:
            if event.delta is not None:
                records = [render(piece) for piece in pieces.feed(event.delta.text)]
                if logprobs and event.delta.logprobs:
                    records = records or [render(empty)]
                    tokens = _token_logprobs(service, event.delta.logprobs)
                    records[0] = {**records[0], "logprobs": tokens}
                for record in records:
                    yield ndjson_line({**head, "created_at": _now(), **record, "done": False})
            if event.result is None:
                continue
            try:
                generation.check(event.result)
            except APIError as exc:
                yield ndjson_line({"error": exc.message})
                return
            for piece in pieces.finish():
                yield ndjson_line({**head, "created_at": _now(), **render(piece), "done": False})
            final = {**head, "created_at": _now(), **render(empty)}
            yield ndjson_line(
                {**final, **_done(event.result), **_metrics(generation, event.result, arrival)}
            )


def _loaded(head: dict, body: dict, reason: str = "load") -> dict:
    """The answer to a request without a prompt, which only asks for the model to be loaded (or
    unloaded: reason "unload")."""
    return {**head, "created_at": _now(), **body, "done": True, "done_reason": reason}


@router.post("/api/chat")
async def chat(body: OllamaChatRequest, request: Request):
    received = time.perf_counter()
    model = ollama_name(body.model)
    keep_alive = keep_alive_seconds(body.keep_alive)
    head = {"model": body.model}
    empty = {"message": {"role": "assistant", "content": ""}}
    if keep_alive == 0 and not body.messages:
        await request.app.state.models.unload(model)
        return _loaded(head, empty, "unload")
    service = await model_service(request, model, keep_alive)
    arrival = _Arrival(received, max(received, service.ready))
    refuse_unsupported(body)
    template_kwargs = _thinking(service, body.think)
    if not body.messages:
        return _loaded(head, empty)
    tools = service.tool_use(body.tool_request())
    prompt = await service.chat_prompt(
        [m.template_message() for m in body.messages],
        tools=tools.definitions,
        template_kwargs=template_kwargs,
    )
    params = service.params(
        [prompt],
        _max_tokens(service, prompt, body.options),
        model,
        logprobs=_logprobs(body),
        constraint=await _constraint(service, body.format, tools),
        **_sampling(body.options),
    )
    generation = service.submit([prompt], params)
    parser = service.reasoning_parser
    opened = parser is not None and parser.opened_by(service.tokenizer, prompt)
    if body.stream:
        pieces = _StreamedMessage(tools, parser and parser.stream(opened))
        return NDJSONResponse(
            _records(service, generation, head, pieces, _chat_piece, arrival, body.logprobs)
        )
    [output] = await generation.collect(request)
    result = output.result
    reply = {**head, "created_at": _now()}
    reply["message"] = _whole_message(service, result.text, tools, opened)
    if body.logprobs:
        reply["logprobs"] = _token_logprobs(service, output.logprobs)
    return {**reply, **_done(result), **_metrics(generation, result, arrival)}


def _chat_piece(piece: dict) -> dict:
    return {"message": piece}


def _generate_piece(piece: dict) -> dict:
    """A chat piece as /api/generate has it: response and thinking at the top."""
    if "thinking" in piece:
        return {"response": "", "thinking": piece["thinking"]}
    return {"response": piece["content"]}


async def _generate_prompt(
    service: GenerationService, body: OllamaGenerateRequest, template_kwargs: dict | None
) -> list[int]:
    """raw: the prompt as it is (with the tokenizer's bos); else the chat template's rendering of
    the system text and the prompt as a user message."""
    if body.raw:
        for name in ("system", "think"):
            if getattr(body, name) is not None:
                raise APIError(
                    400,
                    f"{name} needs the chat template, which raw leaves out; write it into the "
                    "prompt, or leave raw out",
                    param=name,
                )
        if body.images:
            raise APIError(
                400,
                "images need the chat template to place them, which raw leaves out; send them "
                "without raw",
                param="images",
            )
        return await service.text_prompt(body.prompt)
    messages = [{"role": "user", "content": body.user_content()}]
    if body.system:
        messages.insert(0, {"role": "system", "content": body.system})
    return await service.chat_prompt(messages, template_kwargs=template_kwargs)


@router.post("/api/generate")
async def generate(body: OllamaGenerateRequest, request: Request):
    received = time.perf_counter()
    model = ollama_name(body.model)
    keep_alive = keep_alive_seconds(body.keep_alive)
    head = {"model": body.model}
    if keep_alive == 0 and not body.prompt:
        await request.app.state.models.unload(model)
        return _loaded(head, {"response": ""}, "unload")
    service = await model_service(request, model, keep_alive)
    arrival = _Arrival(received, max(received, service.ready))
    refuse_unsupported(body)
    template_kwargs = _thinking(service, body.think)
    if not body.prompt:
        return _loaded(head, {"response": ""})
    prompt = await _generate_prompt(service, body, template_kwargs)
    params = service.params(
        [prompt],
        _max_tokens(service, prompt, body.options),
        model,
        logprobs=_logprobs(body),
        constraint=await _constraint(service, body.format, ToolUse()),
        **_sampling(body.options),
    )
    generation = service.submit([prompt], params)
    parser = service.reasoning_parser
    opened = not body.raw and parser is not None and parser.opened_by(service.tokenizer, prompt)
    if body.stream:
        pieces = _StreamedMessage(ToolUse(), parser and parser.stream(opened))
        return NDJSONResponse(
            _records(service, generation, head, pieces, _generate_piece, arrival, body.logprobs)
        )
    [output] = await generation.collect(request)
    result = output.result
    message = _whole_message(service, result.text, ToolUse(), opened)
    reply = {**head, "created_at": _now(), "response": message["content"]}
    if "thinking" in message:
        reply["thinking"] = message["thinking"]
    if body.logprobs:
        reply["logprobs"] = _token_logprobs(service, output.logprobs)
    return {**reply, **_done(result), **_metrics(generation, result, arrival)}


def _size(model: ServedModel) -> int:
    """The bytes the model's weights take in memory, or its files on disk while unloaded."""
    if model.service is None:
        return model.disk_bytes()
    weights = model.service.engine.model
    tensors = [*weights.parameters(), *weights.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _model_entry(model: ServedModel, name: str) -> dict:
    """What Ollama's lists say of a served model or LoRA adapter (whose parent is the model).
    astrai keeps no Ollama blobs: the digest is a hash of the served name, and details that
    only a Modelfile would say are empty."""
    service = model.service
    return {
        "name": name,
        "model": name,
        "size": _size(model),
        "digest": hashlib.sha256(name.encode()).hexdigest(),
        "details": {
            "parent_model": model.name if service and service.adapter_for(name) else "",
            "format": "",
            "family": "",
            "families": None,
            "parameter_size": "",
            "quantization_level": "",
        },
    }


def _timestamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def _served(model: ServedModel) -> list[str]:
    """The names model goes by: its own, and its adapters' while it is loaded."""
    return [model.name] if model.service is None else model.service.served_models()


@router.get("/api/tags")
async def tags(request: Request) -> dict:
    models: ModelRegistry = request.app.state.models
    return {
        "models": [
            {**_model_entry(model, name), "modified_at": _timestamp(model.modified())}
            for model in models.models.values()
            for name in _served(model)
        ]
    }


@router.get("/api/ps")
async def running(request: Request) -> dict:
    """The loaded models, each to be unloaded its keep_alive (or --idle-unload) seconds after
    its last use, or never."""
    models: ModelRegistry = request.app.state.models
    entries = []
    for model in models.loaded():
        engine = model.service.engine
        on_gpu = next(engine.model.parameters()).device.type != "cpu"
        expires_at = NEVER
        idle_seconds = models.idle_seconds(model)
        if idle_seconds is not None:
            idle = 0.0 if model.leases else time.monotonic() - model.last_used
            expires_at = _timestamp(time.time() + idle_seconds - idle)
        for name in _served(model):
            entry = _model_entry(model, name)
            entries.append(
                {
                    **entry,
                    "expires_at": expires_at,
                    "size_vram": entry["size"] if on_gpu else 0,
                    "context_length": engine.max_seq_len,
                }
            )
    return {"models": entries}


@router.post("/api/show")
async def show(body: OllamaShowRequest, request: Request) -> dict:
    model = ollama_name(body.model or body.name)
    service = await model_service(request, model)
    served: ServedModel = request.app.state.models.find(model)
    refuse_unsupported(body)
    config = service.engine.model.config
    # Clients read the context length as model_info[f"{general.architecture}.context_length"].
    arch = "astrai"
    capabilities = ["completion"]
    if service.tool_parser is not None:
        capabilities.append("tools")
    if service.reasoning_parser is not None:
        capabilities.append("thinking")
    templates = service.tokenizer.chat_templates
    return {
        "license": "",
        "modelfile": "",
        "parameters": "",
        "template": templates.get("default", next(iter(templates.values()), "")),
        "details": _model_entry(served, model)["details"],
        "model_info": {
            "general.architecture": arch,
            f"{arch}.context_length": service.engine.max_seq_len,
            f"{arch}.embedding_length": config.dim,
            f"{arch}.block_count": config.n_layers,
            f"{arch}.attention.head_count": config.n_heads,
            f"{arch}.attention.head_count_kv": config.n_kv_heads,
            f"{arch}.vocab_size": config.vocab_size,
        },
        "capabilities": capabilities,
        "modified_at": _timestamp(served.modified()),
    }


@router.get("/api/version")
async def version() -> dict:
    return {"version": OLLAMA_VERSION}
