"""Runs HTTP requests on the engine: prompts, parameters, submission, streams, aborts."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from astrai.inference import (
    EngineClosedError,
    GenerationError,
    GenerationParams,
    InferenceEngine,
    PromptTooLongError,
    QueueFullError,
    RequestAbortedError,
    RequestError,
    RequestStream,
    StreamEvent,
    TaskResult,
    TokenLogprob,
)
from astrai.inference.constraints import Constraint, ConstraintError
from astrai.inference.engine import ImagePrompt, render_parts
from astrai.model.lora import UnknownAdapterError
from astrai.model.vision.decode import ImageError, ImageLimits, decode_image
from astrai.server.errors import CLIENT_CLOSED, APIError
from astrai.server.media import MediaFetcher, MediaFetchError
from astrai.server.metrics import ServerMetrics
from astrai.server.protocol import RequestImage
from astrai.server.reasoning import ReasoningParser
from astrai.server.tool_parsers import HermesParser, ToolCallParser, ToolRequest, ToolUse
from astrai.tokenize import ChatTemplateError

log = logging.getLogger(__name__)

# The roles every chat template is written for; another is a custom role, which the template
# must show.
STANDARD_ROLES = frozenset({"system", "user", "assistant", "tool"})

SHUTTING_DOWN = (
    "the server is shutting down and stopped this request before it finished; "
    "send it again, to another instance or once the server is back"
)


@dataclass
class ChoiceOutput:
    """What one sample produced, gathered from its stream: the result and its logprobs."""

    result: TaskResult | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Generation:
    """The engine stream of one HTTP request: every prompt's n samples, merged.

    An event's index is its choice: sample i % n of prompt i // n, the numbering OpenAI uses.
    """

    def __init__(
        self,
        stream: RequestStream,
        n: int,
        prompt_tokens: int,
        metrics: ServerMetrics,
        arrival: float,
    ) -> None:
        self.stream = stream
        self.n = n
        self.num_choices = len(stream.tasks)
        self.prompt_tokens = prompt_tokens
        self.metrics = metrics
        self.arrival = arrival
        self.stopped_by_shutdown = False
        # When the first token and the last result came (perf_counter), for Ollama's durations.
        self.first_token_time: float | None = None
        self.end_time: float | None = None
        # What the events so far added up to, for usage reported while streaming.
        self._completion_tokens = [0] * self.num_choices
        self._cached_tokens = [0] * self.num_choices

    def stop_for_shutdown(self) -> None:
        """Abort every sample; each then ends with the shutting-down error."""
        self.stopped_by_shutdown = True
        self.stream.abort()

    def check(self, result: TaskResult) -> None:
        """Raise the API error of a sample that ended without finishing."""
        try:
            result.raise_for_status()
        except RequestAbortedError as exc:
            if self.stopped_by_shutdown:
                raise APIError(503, SHUTTING_DOWN) from exc
            raise _api_error(exc) from exc
        except GenerationError as exc:
            raise _api_error(exc) from exc

    async def events(self) -> AsyncIterator[StreamEvent]:
        """The events in arrival order; closing it early aborts every sample."""
        last_output: dict[int, float] = {}
        async with aclosing(self.stream) as stream:
            async for event in stream:
                if event.delta is not None:
                    self._completion_tokens[event.index] += len(event.delta.token_ids)
                    self._cached_tokens[event.index] = event.delta.cached_tokens
                if event.delta is not None and event.delta.token_ids:
                    now = time.perf_counter()
                    if self.first_token_time is None:
                        self.first_token_time = now
                        self.metrics.time_to_first_token.observe(now - self.arrival)
                    if event.index in last_output:
                        self.metrics.inter_token_latency.observe(now - last_output[event.index])
                    last_output[event.index] = now
                if event.result is not None:
                    self.end_time = time.perf_counter()
                    self.metrics.generation_tokens.inc(event.result.completion_tokens)
                yield event

    async def collect(self, request: Request) -> list[ChoiceOutput]:
        """Every choice's output; a client that disconnects first aborts every sample."""
        outputs = [ChoiceOutput() for _ in range(self.num_choices)]

        async def gather() -> None:
            async with aclosing(self.events()) as events:
                async for event in events:
                    if event.delta is not None and event.delta.logprobs:
                        outputs[event.index].logprobs.extend(event.delta.logprobs)
                    if event.result is not None:
                        outputs[event.index].result = event.result

        gathering = asyncio.ensure_future(gather())
        disconnect = asyncio.ensure_future(_client_disconnected(request))
        try:
            await asyncio.wait({gathering, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            gathering.cancel()
            await asyncio.gather(gathering, disconnect, return_exceptions=True)
        if gathering.cancelled():
            raise APIError(CLIENT_CLOSED, "the client closed the connection")
        gathering.result()
        for output in outputs:
            self.check(output.result)
        return outputs

    def usage_so_far(self) -> Usage:
        """Token counts of the events seen so far: the whole prompt, the tokens generated yet."""
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=sum(self._completion_tokens),
            cached_tokens=sum(self._cached_tokens[:: self.n]),
        )

    def usage(self, results: Sequence[TaskResult]) -> Usage:
        """Token counts of the whole request; a prompt counts once however many samples it has."""
        firsts = results[:: self.n]
        return Usage(
            prompt_tokens=sum(r.prompt_tokens for r in firsts),
            completion_tokens=sum(r.completion_tokens for r in results),
            cached_tokens=sum(r.cached_tokens for r in firsts),
        )


async def _client_disconnected(request: Request) -> None:
    """Return once the client has gone; the body is already read, so only disconnect remains."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class GenerationService:
    """What the API routers need from the engine: model names, prompts, params, submission."""

    def __init__(
        self,
        engine: InferenceEngine,
        model_name: str,
        metrics: ServerMetrics,
        tool_parser: ToolCallParser | None = None,
        reasoning_parser: ReasoningParser | None = None,
        sampling: dict | None = None,
        media: MediaFetcher | None = None,
    ) -> None:
        """media fetches the images of http(s) URLs; None refuses them."""
        self.engine = engine
        self.media = media
        self.sampling = sampling or {}
        self.model_name = model_name
        self.metrics = metrics
        self.created = int(time.time())
        self.ready = time.perf_counter()  # built once its model has loaded: Ollama's load time
        self.stopping = False
        self._running: weakref.WeakSet[Generation] = weakref.WeakSet()
        # A template that drops the tools can never show the model how to call them: astrai
        # then shows them itself, in Hermes' format, unless another format was named.
        self.template_shows_tools = _template_shows_tools(engine.tokenizer)
        self.shows_tools_itself = not self.template_shows_tools and (
            tool_parser is None or isinstance(tool_parser, HermesParser)
        )
        if self.shows_tools_itself:
            tool_parser = HermesParser()
            log.warning(
                "the chat template drops the tools it is given; astrai writes them into the "
                "system message itself, with earlier calls and results, in Hermes' format "
                "(<tool_call> tags), and reads calls in that format"
            )
        elif not self.template_shows_tools:
            log.warning(
                "the chat template drops the tools it is given, so the model sees none; calls "
                "are read in the %s format named",
                tool_parser.name,
            )
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser

    def stop_running(self) -> None:
        """Refuse new submissions and end every running generation with the shutting-down error."""
        self.stopping = True
        for generation in list(self._running):
            generation.stop_for_shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def compiled(self, name: str, constraint: Constraint) -> Constraint:
        """constraint, compiled off the event loop (the engine caches it for the submit); one
        the grammar library refuses is a 400 naming the request field it came from."""
        try:
            await asyncio.to_thread(self.engine.compile, constraint)
        except ConstraintError as exc:
            raise APIError(400, f"{name}: {exc}", param=name) from exc
        return constraint

    def tool_use(self, request: ToolRequest) -> ToolUse:
        """What a request's tools (OpenAI function definitions), tool_choice and parallel calls
        ask for, whichever API they came through; a 400 for what cannot be honoured.

        A forced call (required, or a named function) is a grammar in the model's format, or
        in Hermes' where none is known (the output is then astrai's to read). Under auto, calls
        are read in the model's format, and strict tools hold a call the model starts to their
        schema from its marker on."""
        functions, choice, parallel = request.functions, request.choice, request.parallel
        if not functions:
            if choice.mode in ("required", "named"):
                raise APIError(400, "tool_choice needs tools to choose from", param="tool_choice")
            return ToolUse()
        definitions = [{"type": "function", "function": dict(f)} for f in functions]
        if choice.mode == "none":
            # Shown by astrai, the tools would teach a call format that none leaves unread.
            return ToolUse(None if self.shows_tools_itself else definitions)
        if choice.mode == "auto":
            parser = self._auto_parser()
            strict = None
            if any(f.get("strict") for f in functions):
                strict = Constraint.grammar(parser.triggered_grammar(functions, parallel))
            return ToolUse(definitions, parser, strict, forced=False, parallel=parallel)
        parser = self.tool_parser or HermesParser()
        if choice.mode == "named":
            functions = [f for f in functions if f["name"] == choice.name]
            if not functions:
                names = ", ".join(repr(f["function"]["name"]) for f in definitions)
                raise APIError(
                    400,
                    f"tool_choice names {choice.name!r}, which is not one of the tools ({names})",
                    param="tool_choice",
                )
            parallel = False
        grammar = Constraint.grammar(parser.grammar(functions, parallel))
        return ToolUse(definitions, parser, grammar, forced=True, parallel=parallel)

    def _auto_parser(self) -> ToolCallParser:
        """The format calls are read in under tool_choice auto; a 400 naming tools when the
        chat template shows the tools in a format astrai does not know."""
        if self.tool_parser is None:
            raise APIError(
                400,
                "tool_choice auto needs to know how this model writes tool calls, and its chat "
                "template shows the tools in no format astrai knows; start astrai serve with "
                "--tool-call-parser hermes, llama3_json or mistral, or force a call with "
                "tool_choice required or a named function",
                param="tools",
            )
        return self.tool_parser

    def served_models(self) -> list[str]:
        """The names a request's model field may take: the base model's, then its adapters'."""
        return [self.model_name, *self.engine.adapter_names()]

    def adapter_for(self, requested: str | None) -> str | None:
        """The LoRA adapter a request's model field names (None: the base model)."""
        return None if requested in (None, self.model_name) else requested

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to this; the model's own count, which may pass the tokenizer's."""
        return self.engine.model.config.vocab_size

    def check_token_ids(self, ids: Sequence[int], field: str) -> None:
        """A 400 naming field when an id lies outside the vocabulary."""
        outside = [t for t in ids if not 0 <= t < self.vocab_size]
        if outside:
            raise APIError(
                400,
                f"{field} holds token ids outside the vocabulary (ids 0..{self.vocab_size - 1}): "
                f"{outside[:5]}; /tokenize gives a text's ids",
                param=field,
            )

    def truncate(self, prompts: list[list[int]], keep: int | None) -> list[list[int]]:
        """vLLM's truncate_prompt_tokens: keep each prompt's last `keep` tokens; -1 keeps what
        fits in the context; None keeps all."""
        if keep is None:
            return prompts
        if any(isinstance(p, ImagePrompt) for p in prompts):
            raise APIError(
                400,
                "truncate_prompt_tokens cannot cut a prompt with images (it could cut an image "
                "in two); leave it out",
                param="truncate_prompt_tokens",
            )
        if keep == -1:
            keep = self.engine.max_seq_len
        if keep == 0:
            raise APIError(
                400,
                "truncate_prompt_tokens must be at least 1 (or -1 for the context length)",
                param="truncate_prompt_tokens",
            )
        return [p[-keep:] for p in prompts]

    def check_message_extras(self, messages: Sequence[Any]) -> None:
        """A 400 naming a message key astrai does not know (a request model's extra) that no
        chat template of the model mentions: the template would drop it, unread."""
        templates = "\n".join(self.tokenizer.chat_templates.values())
        for i, message in enumerate(messages):
            for key in message.model_extra or {}:
                if not re.search(rf"\b{re.escape(key)}\b", templates):
                    where = f"messages.{i}.{key}"
                    raise APIError(
                        400,
                        f"{where}: astrai does not know this field and the chat template does not "
                        "read it; leave it out (docs/api.md)",
                        param=where,
                    )

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int] | ImagePrompt:
        """The same encoding as InferenceEngine.generate by default, so greedy results match it;
        a message's images (RequestImage parts of its content) make it an ImagePrompt.

        A message without content has empty content, as vLLM hands it (templates concatenate
        it). tools (OpenAI function definitions) go to the template as transformers hands them,
        or into the messages when the template drops them. continue_final_message leaves the
        last message open for the answer to continue (an assistant prefill). template_kwargs
        reach the template as variables (enable_thinking, ...).
        add_special_tokens adds the tokenizer's own (a bos) on top of the template's. Encoding
        runs in a worker thread: a prompt of megabytes takes seconds to tokenize, and the event
        loop must keep serving other clients meanwhile.
        """
        tokenizer = self.tokenizer
        messages = [{**m, "content": m.get("content") or ""} for m in messages]
        messages, images = self._placed_images(messages)
        images = [(where, await self._fetched(where, image)) for where, image in images]
        if tools and self.shows_tools_itself:
            messages, tools = self.tool_parser.show_tools(messages, tools), None
        if continue_final_message:
            if messages[-1].get("tool_calls"):
                raise APIError(
                    400,
                    "the last message makes tool calls, so it cannot be continued; send its "
                    "text only, or end the chat with a user or tool message",
                    param="messages",
                )
            add_generation_prompt = False

        def render(messages: list[dict[str, Any]]) -> str:
            return tokenizer.apply_chat_template(
                messages,
                add_generation_prompt,
                tokenize=False,
                tools=tools,
                continue_final_message=continue_final_message,
                **(template_kwargs or {}),
            )

        def encode() -> list[int] | ImagePrompt:
            text = render(messages)
            _check_custom_roles(render, messages)
            ids = tokenizer.encode(text, add_special_tokens)
            return self._image_prompt(ids, images) if images else ids

        try:
            return await asyncio.to_thread(encode)
        except ChatTemplateError as exc:
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc

    def _placed_images(
        self, messages: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[tuple[str, RequestImage]]]:
        """The messages with string contents, each image written as the model's placeholder
        (render_parts), and the images in order, each with where the request holds it; a 400
        for images to a model without vision, or too many."""
        images = [
            (f"messages[{i}]'s image {k + 1}", part)
            for i, message in enumerate(messages)
            if isinstance(message["content"], list)
            for k, part in enumerate(p for p in message["content"] if not isinstance(p, str))
        ]
        if not images:
            return messages, []
        try:
            self.engine.check_images(len(images))
        except RequestError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        placeholder = self.engine.image_placeholder
        rendered = [
            {**m, "content": render_parts(m["content"], placeholder)}
            if isinstance(m["content"], list)
            else m
            for m in messages
        ]
        return rendered, images

    async def _fetched(self, where: str, image: RequestImage) -> RequestImage:
        """The image with its bytes: fetched from its URL, if it has one and the operator
        allows its host; a 400 naming the image otherwise."""
        if image.url is None:
            return image
        if self.media is None:
            raise APIError(
                400,
                f"{where} is a remote URL: astrai does not fetch images from URLs unless the "
                "operator allows their hosts (astrai serve --allowed-media-domains), since "
                "fetching them server-side would let a client reach the server's network; send "
                "the image inline, base64-encoded",
                param="messages",
            )
        try:
            return RequestImage(await self.media.fetch(image.url))
        except MediaFetchError as exc:
            raise APIError(400, f"{where}: {exc}", param="messages") from exc

    def _image_prompt(self, ids: list[int], images: list[tuple[str, RequestImage]]) -> ImagePrompt:
        """The prompt of ids with the images decoded within the engine's limits; a 400 naming
        the image that is not a readable one, or too large."""
        config = self.engine.config
        limits = ImageLimits(config.max_image_bytes, config.max_image_pixels)
        decoded = []
        for where, image in images:
            try:
                decoded.append(decode_image(image.data, limits, where))
            except ImageError as exc:
                raise APIError(400, str(exc), param="messages") from exc
        try:
            return self.engine.image_prompt(ids, decoded)
        except RequestError as exc:
            raise APIError(400, str(exc), param="messages") from exc

    async def text_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of a completion prompt, encoded off the event loop like chat_prompt.

        With add_special_tokens it is the engine's own encoding (bos and all)."""
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    def params(
        self,
        prompts: Sequence[list[int]],
        max_tokens: int | None,
        model: str | None,
        prompt_only: bool = False,
        **fields,
    ) -> GenerationParams:
        """GenerationParams from request fields (None means the server's sampling setting, else
        the engine's default); model, the request's model field, picks the LoRA adapter.

        Without max_tokens a request may generate up to the end of the context. max_tokens 0
        (the prompt alone, for its logprobs) is for the endpoints that say prompt_only.
        """
        if max_tokens == 0 and not prompt_only:
            raise APIError(
                400,
                "max_tokens must be at least 1 (0, the prompt's logprobs alone, is for "
                "/v1/completions)",
            )
        if max_tokens is None:
            limit = self.engine.max_request_tokens
            max_tokens = max(1, limit - max(len(p) for p in prompts))
        settings = self.sampling | {k: v for k, v in fields.items() if v is not None}
        try:
            return GenerationParams(max_tokens=max_tokens, lora=self.adapter_for(model), **settings)
        except RequestError as exc:
            raise APIError(400, str(exc)) from exc

    def submit(self, prompts: Sequence[list[int]], params: GenerationParams) -> Generation:
        """Queue every prompt's samples or none (the engine's submit_all)."""

        def start() -> RequestStream:
            try:
                return self.engine.submit_all_async(prompts, params)
            except UnknownAdapterError as exc:  # unloaded since the request's model was checked
                raise unknown_model(params.lora, self.served_models()) from exc

        return self._submit(prompts, params.n, start)

    def embed(self, prompts: Sequence[list[int]], model: str | None) -> Generation:
        """Queue an embedding task of every prompt or none (the engine's embed_async), under
        the LoRA adapter the request's model field names, if any; each result's embedding is
        the pooled final hidden states, not normalized."""
        lora = self.adapter_for(model)

        def start() -> RequestStream:
            try:
                return self.engine.embed_async(prompts, lora=lora)
            except UnknownAdapterError as exc:  # unloaded since the request's model was checked
                raise unknown_model(lora, self.served_models()) from exc

        return self._submit(prompts, 1, start)

    def _submit(
        self, prompts: Sequence[list[int]], n: int, submit: Callable[[], RequestStream]
    ) -> Generation:
        if self.stopping:
            raise APIError(503, "the server is shutting down and takes no new requests")
        arrival = time.perf_counter()
        try:
            stream = submit()
        except (RequestError, RuntimeError) as exc:
            raise _api_error(exc) from exc
        prompt_tokens = sum(len(p) for p in prompts)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        generation = Generation(stream, n, prompt_tokens, self.metrics, arrival)
        self._running.add(generation)
        return generation


def _check_custom_roles(render: Callable[[list[dict]], str], messages: list[dict]) -> None:
    """A 400 when the chat template leaves out the messages of a custom role: rendered with a
    marker for the content of each, a marker is missing. (A template that refuses the role
    raises instead, which is a 400 too.)"""
    custom = [i for i, m in enumerate(messages) if m["role"] not in STANDARD_ROLES]
    if not custom:
        return
    markers = {i: f"astraiprobe{i}x" for i in custom}
    text = render([{**m, "content": markers.get(i, m["content"])} for i, m in enumerate(messages)])
    for i in custom:
        if markers[i] not in text:
            role = messages[i]["role"]
            raise APIError(
                400,
                f"the chat template leaves out messages of role {role!r}, so the model would "
                "never see them; send them as system, user or assistant messages",
                param="messages",
            )


def _template_shows_tools(tokenizer) -> bool:
    """Whether the chat template writes the tools it is given into the prompt (a template
    that fails on the probe, or a model without one, counts as showing them)."""
    name = "astrai_probe_function"
    tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}], True, tokenize=False, tools=[tool]
        )
    except ChatTemplateError:
        return True
    return name in text


def unknown_model(requested: str, served: list[str]) -> APIError:
    return APIError(
        404,
        f"the model {requested!r} does not exist; this server serves {served}",
        param="model",
        code="model_not_found",
    )


def _api_error(exc: RequestError | RuntimeError) -> APIError:
    """The HTTP status and message of an engine error.

    The engine's own failures are logged here and answered without their text, which describes
    the code, not the request.
    """
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, RequestError):
        return APIError(400, str(exc))
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc))
    if isinstance(exc, EngineClosedError):
        return APIError(503, "the engine has stopped and takes no more requests")
    if isinstance(exc, RequestAbortedError):  # the engine stopped; it logged why
        return APIError(503, "the engine stopped before this request finished; send it again")
    log.error("a request failed in the engine: %s", exc)
    return APIError(500, "the engine failed while generating this request; the server log says why")
