"""OpenAI-compatible endpoints: chat completions, completions and models."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing

from fastapi import APIRouter, Request

from astrai.inference import TaskDelta, TaskResult
from astrai.inference.constraints import Constraint, ConstraintError
from astrai.server.errors import APIError, openai_error_body
from astrai.server.fields import refuse_unsupported
from astrai.server.generation import ChoiceOutput, Generation, GenerationService, Usage
from astrai.server.logprobs import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    joined_logprobs,
    prompt_logprobs,
)
from astrai.server.protocol import ChatCompletionRequest, CompletionRequest
from astrai.server.reasoning import ReasoningStream
from astrai.server.registry import ModelRegistry, ServedModel, model_service
from astrai.server.sse import EventStreamResponse, sse_data
from astrai.server.tool_parsers import (
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolUse,
)

router = APIRouter()


def _sampling(body: ChatCompletionRequest | CompletionRequest) -> dict:
    """The request's sampling fields as GenerationParams keywords; top_k -1 means off."""
    return {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": 0 if body.top_k == -1 else body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "seed": body.seed,
        "stop": body.stop,
        "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos,
        "min_tokens": body.min_tokens,
        "logit_bias": body.logit_bias,
        "allowed_token_ids": body.allowed_token_ids,
        "n": body.n,
        "prompt_logprobs": body.prompt_logprobs,
    }


# The fields that constrain the output, each with how it becomes a Constraint (None: free).
_CONSTRAINT_FIELDS = {
    "response_format": Constraint.from_response_format,
    "structured_outputs": Constraint.from_structured_outputs,
    **{
        name: lambda value, name=name: Constraint.from_guided({name: value})
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
    },
}


async def _constraint(
    service: GenerationService,
    body: ChatCompletionRequest | CompletionRequest,
    tools_constraint: Constraint | None = None,
) -> Constraint | None:
    """The output constraint the request asks for, compiled off the event loop (the engine
    caches it for the submit); a bad one, or two, is a 400 naming the field.

    tools_constraint is the one the tools put on the answer (ToolUse.constraint)."""
    asked = [] if tools_constraint is None else [("tools", tools_constraint)]
    for name, build in _CONSTRAINT_FIELDS.items():
        value = getattr(body, name)
        if value is None:
            continue
        if name in ("response_format", "structured_outputs") and not isinstance(value, Mapping):
            raise APIError(400, f"{name} must be an object", param=name)
        try:
            constraint = build(value)
        except ConstraintError as exc:
            raise APIError(400, f"{name}: {exc}", param=name) from exc
        if constraint is not None:
            asked.append((name, constraint))
    if not asked:
        return None
    if len(asked) > 1:
        names = " and ".join(name for name, _ in asked)
        raise APIError(400, f"{names} both constrain the output; give one", param=asked[1][0])
    [(name, constraint)] = asked
    return await service.compiled(name, constraint)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(call: ToolCall) -> dict:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": _call_id(), "type": "function", "function": function}


def _chat_message(text: str, tools: ToolUse) -> tuple[dict, bool]:
    """The assistant message of an answer, and whether it calls tools; a forced answer has no
    content (what a cut-off call left is dropped)."""
    if tools.parser is not None:
        content, calls = tools.parser.parse(text)
        if calls:
            calls = calls if tools.parallel else calls[:1]
            message = {"role": "assistant", "content": content or None}
            return {**message, "tool_calls": [_tool_call(call) for call in calls]}, True
    return {"role": "assistant", "content": None if tools.forced else text}, False


def _finish_reason(result: TaskResult, called: bool) -> str:
    """length when max_tokens cut the answer, even after complete calls; else tool_calls for
    an answer that calls tools."""
    if called and result.finish_reason != "length":
        return "tool_calls"
    return result.finish_reason


def _usage(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _stop_text(body: ChatCompletionRequest | CompletionRequest, result: TaskResult) -> str:
    """vLLM's include_stop_str_in_output: the stop string that ended the text, put back."""
    if body.include_stop_str_in_output and isinstance(result.stop_reason, str):
        return result.stop_reason
    return ""


def _include_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _continuous_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """vLLM's: the usage include_usage adds, on every chunk; without include_usage there is
    none to add, as in vLLM."""
    return _include_usage(body) and body.stream_options.continuous_usage_stats


# Variables of the chat template that astrai sets itself.
_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
)


def _template_kwargs(body: ChatCompletionRequest) -> dict:
    """chat_template_kwargs, the chat template's own variables (enable_thinking, ...)."""
    kwargs = body.chat_template_kwargs or {}
    taken = sorted(_TEMPLATE_VARIABLES & set(kwargs))
    if taken:
        raise APIError(
            400,
            f"chat_template_kwargs may not set {taken[0]!r}, which astrai sets from the "
            "request's own fields",
            param="chat_template_kwargs",
        )
    return kwargs


def _check_request(body: ChatCompletionRequest | CompletionRequest) -> None:
    """The checks both endpoints share: refused fields, stream options.

    Token ids in stop_token_ids, logit_bias and allowed_token_ids are the engine's to check."""
    refuse_unsupported(body)
    if body.stream_options is not None and not body.stream:
        raise APIError(
            400, "stream_options needs stream set to true; leave it out", param="stream_options"
        )
    if body.stream and body.prompt_logprobs is not None:
        raise APIError(
            400,
            "prompt_logprobs are not available when stream is true (as in vLLM); leave out "
            "stream or prompt_logprobs",
            param="prompt_logprobs",
        )


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    models: ModelRegistry = request.app.state.models
    cards = [
        _model_card(model, name)
        for model in models.models.values()
        for name in ([model.name] if model.service is None else model.service.served_models())
    ]
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict:
    models: ModelRegistry = request.app.state.models
    return _model_card(models.find(model_id), model_id)


def _model_card(model: ServedModel, model_id: str) -> dict:
    """The card of a model, or of a LoRA adapter of it: its parent is the model (vLLM's).

    status says whether it is loaded (llama.cpp's); what only the loaded model tells is null
    while it is not."""
    service = model.service
    card = {
        "id": model_id,
        "object": "model",
        "created": int(model.modified()),
        "owned_by": "astrai",
        "parent": None,
        "max_model_len": None,
        "tool_call_parser": None,
        "tools_shown_by": None,
        "status": {"value": model.status},
    }
    if service is None:
        return card
    parser = service.tool_parser
    return {
        **card,
        "created": service.created,
        "parent": service.adapter_for(model_id) and service.model_name,
        "max_model_len": service.engine.max_seq_len,
        # astrai's: the format tool calls are read in under tool_choice auto (null: only forced
        # calls), and who shows the model its tools: its chat template, or astrai.
        "tool_call_parser": None if parser is None else parser.name,
        "tools_shown_by": "chat_template"
        if service.template_shows_tools
        else ("astrai" if service.shows_tools_itself else "nobody"),
    }


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    service = await model_service(request, body.model)
    _check_request(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    # vLLM refuses both set true; left out, add_generation_prompt gives way.
    asked_for_both = "add_generation_prompt" in body.model_fields_set and body.add_generation_prompt
    if body.continue_final_message and asked_for_both:
        raise APIError(
            400,
            "continue_final_message continues the last message and add_generation_prompt "
            "opens a new one; set add_generation_prompt to false or leave it out",
            param="continue_final_message",
        )
    tools = service.tool_use(body.tool_request())
    service.check_message_extras(body.messages)
    messages = [m.template_message() for m in body.messages]
    prompt = await service.chat_prompt(
        messages,
        body.add_generation_prompt,
        body.add_special_tokens,
        tools.definitions,
        continue_final_message=body.continue_final_message,
        template_kwargs=_template_kwargs(body),
    )
    parser = service.reasoning_parser
    opened = parser is not None and parser.opened_by(service.tokenizer, prompt)
    [prompt] = service.truncate([prompt], body.truncate_prompt_tokens)
    max_tokens = body.max_tokens
    if body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    params = service.params(
        [prompt],
        max_tokens,
        body.model,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        constraint=await _constraint(service, body, tools.constraint),
        **_sampling(body),
    )
    generation = service.submit([prompt], params)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time())}
    head["model"] = params.lora or service.model_name
    if body.stream:
        return EventStreamResponse(_chat_chunks(generation, head, service, body, tools, opened))
    outputs = await generation.collect(request)
    choices = []
    for i, out in enumerate(outputs):
        text = out.result.text + _stop_text(body, out.result)
        reasoning = None
        if service.reasoning_parser is not None:
            reasoning, text = service.reasoning_parser.split(text, opened)
        message, called = _chat_message(text, tools)
        if service.reasoning_parser is not None:
            message["reasoning_content"] = reasoning
        lp = chat_logprobs(service.tokenizer, out.logprobs) if body.logprobs else None
        finish_reason = _finish_reason(out.result, called)
        choices.append(
            {"index": i, "message": message, "logprobs": lp, "finish_reason": finish_reason}
        )
    usage = generation.usage([out.result for out in outputs])
    response = {**head, "object": "chat.completion", "choices": choices, "usage": _usage(usage)}
    if body.prompt_logprobs is not None:
        entries = outputs[0].result.prompt_logprobs
        response["prompt_logprobs"] = prompt_logprobs(
            service.tokenizer, entries, body.prompt_logprobs
        )
    return response


async def _stream_chunks(
    generation: Generation,
    head: dict,
    obj: str,
    body: ChatCompletionRequest | CompletionRequest,
    render_delta: Callable[[int, TaskDelta], list[dict]],
    render_finish: Callable[[int, TaskResult], list[dict]],
    opening: Sequence[dict] = (),
) -> AsyncIterator[str]:
    """The SSE frames of one streamed OpenAI response, for chat and completions alike.

    The choice entries, one a chunk, come from the endpoint's renderers; this owns the usage of
    every chunk under include_usage (null, or the counts so far under continuous_usage_stats),
    the final usage chunk, errors and the closing [DONE]. A sample's finish_reason rides on the
    chunk of its last token's text, as vLLM sends it, not on an empty chunk after it: the
    entries of a sample's last delta wait for its result, which comes right after, to be merged
    with.
    """
    include_usage, continuous_usage = _include_usage(body), _continuous_usage(body)

    def chunk(entry: dict) -> dict:
        """The chunk of one entry, with the usage as of now (held chunks keep theirs)."""
        data = {**head, "object": obj, "choices": [entry]}
        if include_usage:
            data["usage"] = _usage(generation.usage_so_far()) if continuous_usage else None
        return data

    for entry in opening:
        yield sse_data(chunk(entry))
    results = {}
    held: dict[int, list[dict]] = {}  # the chunks of samples' last deltas, until their result
    async with aclosing(generation.events()) as events:
        async for event in events:
            if event.delta is not None:
                chunks = [chunk(entry) for entry in render_delta(event.index, event.delta)]
                if event.delta.last:
                    held[event.index] = chunks
                else:
                    for data in chunks:
                        yield sse_data(data)
            if event.result is not None:
                try:
                    generation.check(event.result)
                except APIError as exc:
                    yield sse_data(openai_error_body(exc.status, exc.message, None, None))
                    yield sse_data("[DONE]")
                    return
                results[event.index] = event.result
                closing = [chunk(entry) for entry in render_finish(event.index, event.result)]
                for data in _finish_on_last_text(held.pop(event.index, []) + closing):
                    yield sse_data(data)
    if include_usage:
        usage = generation.usage([results[i] for i in range(generation.num_choices)])
        yield sse_data({**head, "object": obj, "choices": [], "usage": _usage(usage)})
    yield sse_data("[DONE]")


def _finish_on_last_text(chunks: list[dict]) -> list[dict]:
    """A sample's last chunks with the closing one's finish_reason moved onto the chunk before
    it when the closing one carries nothing else (no text, delta or logprobs)."""
    *rest, closing = chunks
    [entry] = closing["choices"]
    empty = entry.get("delta", {}) == {} and not entry.get("text") and entry["logprobs"] is None
    if not (rest and empty):
        return chunks
    [last] = rest[-1]["choices"]
    return [
        *rest[:-1],
        {**rest[-1], "choices": [{**last, "finish_reason": entry["finish_reason"]}]},
    ]


def _chat_chunks(
    generation: Generation,
    head: dict,
    service: GenerationService,
    body: ChatCompletionRequest,
    tools: ToolUse,
    opened: bool,
) -> AsyncIterator[str]:
    """opened: the prompt left a think block open for the answer to close."""
    tokenizer = service.tokenizer
    choices = range(generation.num_choices)
    parser = service.reasoning_parser
    calls = [_StreamedCalls(tools, parser and parser.stream(opened)) for _ in choices]

    def entry(choice: int, delta: dict, logprobs: dict | None = None) -> dict:
        return {"index": choice, "delta": delta, "logprobs": logprobs, "finish_reason": None}

    def render_delta(choice: int, delta: TaskDelta) -> list[dict]:
        entries = [entry(choice, d) for d in calls[choice].feed(delta.text)]
        if body.logprobs and delta.logprobs:
            if not entries:
                entries = [entry(choice, {})]
            entries[0]["logprobs"] = chat_logprobs(tokenizer, delta.logprobs)
        return entries

    def render_finish(choice: int, result: TaskResult) -> list[dict]:
        deltas = calls[choice].feed(_stop_text(body, result)) + calls[choice].finish()
        last = deltas.pop() if deltas and "content" in deltas[-1] else {}
        finish_reason = _finish_reason(result, calls[choice].called)
        closing = {**entry(choice, last), "finish_reason": finish_reason}
        return [entry(choice, d) for d in deltas] + [closing]

    opening = [entry(i, {"role": "assistant", "content": ""}) for i in choices]
    return _stream_chunks(
        generation,
        head,
        "chat.completion.chunk",
        body,
        render_delta,
        render_finish,
        opening,
    )


def _reasoning_deltas(reasoning: str) -> list[dict]:
    return [{"reasoning_content": reasoning}] if reasoning else []


class _StreamedCalls:
    """One choice's streamed text as chat deltas: content, or tool calls as OpenAI streams them
    (a call's index, id, type and name first, then fragments of its arguments)."""

    def __init__(self, tools: ToolUse, reasoning: ReasoningStream | None = None) -> None:
        self._stream: ToolCallStream | None = (
            None if tools.parser is None else tools.parser.stream()
        )
        self._parallel = tools.parallel
        self._forced = tools.forced
        self._reasoning = reasoning
        self.called = False

    def feed(self, text: str) -> list[dict]:
        """The deltas of a piece of text: reasoning_content first, as vLLM streams it."""
        if self._reasoning is None:
            return self._answer(text)
        reasoning, text = self._reasoning.feed(text)
        return _reasoning_deltas(reasoning) + self._answer(text)

    def finish(self) -> list[dict]:
        deltas = []
        if self._reasoning is not None:
            reasoning, text = self._reasoning.finish()
            deltas = _reasoning_deltas(reasoning) + self._answer(text)
        return deltas + ([] if self._stream is None else self._deltas(self._stream.finish(), []))

    def _answer(self, text: str) -> list[dict]:
        if self._stream is None:
            return [{"content": text}] if text else []
        content, calls = self._stream.feed(text)
        return self._deltas(content, calls)

    def _deltas(self, content: str, calls: list[ToolCallDelta]) -> list[dict]:
        deltas = [{"content": content}] if content and not self._forced else []
        for call in calls:
            if call.index > 0 and not self._parallel:
                continue
            if call.name is not None:
                self.called = True
                function = {"name": call.name, "arguments": ""}
                piece = {"index": call.index, "id": _call_id(), "type": "function"}
                deltas.append({"tool_calls": [{**piece, "function": function}]})
            if call.arguments:
                piece = {"index": call.index, "function": {"arguments": call.arguments}}
                deltas.append({"tool_calls": [piece]})
        return deltas


async def _completion_prompts(
    service: GenerationService, body: CompletionRequest
) -> tuple[list[list[int]], list[str | None]]:
    """Each prompt's token ids and, where it was given as text, that text.

    A prompt may be a string, a list of strings, a list of ids or a list of id lists.
    """
    prompt = body.prompt
    if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    ids, texts = [], []
    for p in prompt:
        if isinstance(p, str):
            ids.append(await service.text_prompt(p, body.add_special_tokens))
            texts.append(p)
        else:
            ids.append(list(p))
            texts.append(None)
    return ids, texts


def _best_of(body: CompletionRequest) -> int:
    """How many samples to draw per prompt: best_of, or n without it."""
    if body.best_of is None:
        return body.n
    if body.best_of < body.n:
        raise APIError(
            400, f"best_of ({body.best_of}) must be at least n ({body.n})", param="best_of"
        )
    if body.best_of > body.n and body.stream:
        raise APIError(
            400,
            "best_of above n cannot stream: the best samples are known only once all have "
            "finished; leave out stream or best_of",
            param="best_of",
        )
    return body.best_of


def _best(outputs: list[ChoiceOutput], best_of: int, n: int) -> list[ChoiceOutput]:
    """Each prompt's n samples of highest cumulative logprob out of its best_of, best first."""
    if best_of == n:
        return outputs
    kept = []
    for start in range(0, len(outputs), best_of):
        samples = outputs[start : start + best_of]
        samples.sort(key=lambda out: sum(entry.logprob for entry in out.logprobs), reverse=True)
        kept.extend(samples[:n])
    return kept


def _echoes(
    service: GenerationService,
    body: CompletionRequest,
    encoded: list[list[int]],
    prompts: list[list[int]],
    texts: list[str | None],
) -> list[str]:
    """Each prompt's text to put before its choices: empty without echo; the prompt as it was
    sent, or its ids (or truncated text) as the tokenizer decodes them."""
    if not body.echo:
        return [""] * len(prompts)
    return [
        text if text is not None and kept == ids else service.tokenizer.decode(kept)
        for ids, kept, text in zip(encoded, prompts, texts, strict=True)
    ]


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    service = await model_service(request, body.model)
    _check_request(body)
    best_of = _best_of(body)
    echo_scored = body.echo and body.logprobs is not None
    if echo_scored and body.stream and best_of > 1:
        raise APIError(
            400,
            "a stream with echo and logprobs carries the prompt's logprobs for one sample "
            "only; leave out n and best_of, or stream",
            param="echo",
        )
    encoded, texts = await _completion_prompts(service, body)
    prompts = service.truncate(encoded, body.truncate_prompt_tokens)
    # Ranking best_of samples needs every token's logprob, asked for or not.
    logprobs = 0 if best_of > body.n and body.logprobs is None else body.logprobs
    sampling = {**_sampling(body), "n": best_of}
    # The prompt's logprobs for echo and for prompt_logprobs, with the larger top k of both.
    asked = [k for k in (body.prompt_logprobs, body.logprobs if echo_scored else None) if k]
    if echo_scored or body.prompt_logprobs is not None:
        sampling["prompt_logprobs"] = max(asked, default=0)
    constraint = await _constraint(service, body)
    params = service.params(
        prompts,
        body.max_tokens,
        body.model,
        prompt_only=True,
        logprobs=logprobs,
        constraint=constraint,
        **sampling,
    )
    generation = service.submit(prompts, params)
    echoes = _echoes(service, body, encoded, prompts, texts)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time())}
    head["model"] = params.lora or service.model_name
    want_logprobs = body.logprobs is not None
    if body.stream:
        return EventStreamResponse(
            _completion_chunks(generation, head, service.tokenizer, body, echoes, prompts)
        )
    outputs = await generation.collect(request)
    # A prompt's first sample computed its prompt logprobs for all of them.
    firsts = [outputs[p * best_of].result for p in range(len(prompts))]
    choices = []
    for i, out in enumerate(_best(outputs, best_of, body.n)):
        first = firsts[i // body.n]
        lp = None
        if echo_scored:
            lp, offset = echo_logprobs(
                service.tokenizer, prompts[i // body.n], first.prompt_logprobs, body.logprobs
            )
            generated, _ = completion_logprobs(service.tokenizer, out.logprobs, offset)
            lp = joined_logprobs(lp, generated)
        elif want_logprobs:
            lp = completion_logprobs(service.tokenizer, out.logprobs)[0]
        choice = {
            "index": i,
            "text": echoes[i // body.n] + out.result.text + _stop_text(body, out.result),
            "logprobs": lp,
            "finish_reason": out.result.finish_reason,
        }
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(
                service.tokenizer, first.prompt_logprobs, body.prompt_logprobs
            )
        choices.append(choice)
    usage = generation.usage([out.result for out in outputs])
    return {**head, "object": "text_completion", "choices": choices, "usage": _usage(usage)}


def _completion_chunks(
    generation: Generation,
    head: dict,
    tokenizer,
    body: CompletionRequest,
    echoes: Sequence[str],
    prompts: Sequence[list[int]],
) -> AsyncIterator[str]:
    """Under echo with logprobs (one sample) the echo waits for the prompt's logprobs, which
    come with the first token, or with the result when none is generated (max_tokens 0)."""
    want_logprobs = body.logprobs is not None
    echo_scored = body.echo and want_logprobs
    offsets = [0] * generation.num_choices  # text_offset carries on across chunks
    echoed = [not echo_scored] * generation.num_choices

    def echo(choice: int, entries: list) -> tuple[str, dict]:
        echoed[choice] = True
        lp, offsets[choice] = echo_logprobs(tokenizer, prompts[choice], entries, body.logprobs)
        return echoes[choice], lp

    def render_delta(choice: int, delta: TaskDelta) -> list[dict]:
        text, lp = "", None
        if not echoed[choice] and delta.prompt_logprobs is not None:
            text, lp = echo(choice, delta.prompt_logprobs)
        if not (text or delta.text or (want_logprobs and delta.logprobs)):
            return []
        if want_logprobs:
            own, offsets[choice] = completion_logprobs(
                tokenizer, delta.logprobs or [], offsets[choice]
            )
            lp = own if lp is None else joined_logprobs(lp, own)
        text += delta.text
        return [{"index": choice, "text": text, "logprobs": lp, "finish_reason": None}]

    def render_finish(choice: int, result: TaskResult) -> list[dict]:
        text, lp = "", None
        if not echoed[choice] and result.prompt_logprobs is not None:
            text, lp = echo(choice, result.prompt_logprobs)
        text, finish_reason = text + _stop_text(body, result), result.finish_reason
        return [{"index": choice, "text": text, "logprobs": lp, "finish_reason": finish_reason}]

    opening = [
        {"index": i, "text": echoes[i // body.n], "logprobs": None, "finish_reason": None}
        for i in range(generation.num_choices)
        if echoes[i // body.n] and not echo_scored
    ]
    return _stream_chunks(
        generation, head, "text_completion", body, render_delta, render_finish, opening
    )
