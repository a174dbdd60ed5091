"""Runs HTTP requests on the engine: prompts, parameters, submission, merged streams, aborts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request

from astrai.inference import (
    GenerationParams,
    GenerationRequest,
    InferenceEngine,
    StreamEvent,
    TaskResult,
)
from astrai.inference.task import PromptTooLongError, QueueFullError, RequestError, TokenLogprob
from astrai.server.errors import APIError
from astrai.server.metrics import ServerMetrics
from astrai.tokenize import ChatTemplateError


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
    """The engine streams of one HTTP request: one per prompt, n samples each.

    Choice index i is sample i % n of prompt i // n, the numbering OpenAI uses.
    """

    def __init__(
        self,
        streams: list[AsyncIterator[StreamEvent]],
        n: int,
        metrics: ServerMetrics,
        arrival: float,
    ) -> None:
        self.streams = streams
        self.n = n
        self.num_choices = len(streams) * n
        self.metrics = metrics
        self.arrival = arrival

    async def events(self) -> AsyncIterator[tuple[int, StreamEvent]]:
        """(choice index, event) in arrival order; closing it early aborts every sample."""
        first_token_seen = False
        last_output: dict[int, float] = {}
        async with aclosing(self._merged()) as merged:
            async for prompt_index, event in merged:
                choice = prompt_index * self.n + event.index
                if event.delta is not None and event.delta.token_ids:
                    now = time.perf_counter()
                    if not first_token_seen:
                        first_token_seen = True
                        self.metrics.time_to_first_token.observe(now - self.arrival)
                    if choice in last_output:
                        self.metrics.inter_token_latency.observe(now - last_output[choice])
                    last_output[choice] = now
                if event.result is not None:
                    self.metrics.generation_tokens.inc(event.result.completion_tokens)
                yield choice, event

    async def _merged(self) -> AsyncIterator[tuple[int, StreamEvent]]:
        # Closing an engine stream (or cancelling the task iterating it) aborts its samples.
        if len(self.streams) == 1:
            async with aclosing(self.streams[0]) as stream:
                async for event in stream:
                    yield 0, event
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(prompt_index: int, stream) -> None:
            try:
                async for event in stream:
                    merged.put_nowait((prompt_index, event))
            finally:
                merged.put_nowait((prompt_index, None))

        pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            open_streams = len(pumps)
            while open_streams:
                prompt_index, event = await merged.get()
                if event is None:
                    open_streams -= 1
                else:
                    yield prompt_index, event
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def collect(self, request: Request) -> list[ChoiceOutput] | None:
        """Every choice's output; None if the client disconnected first (all samples aborted)."""
        outputs = [ChoiceOutput() for _ in range(self.num_choices)]

        async def gather() -> None:
            async with aclosing(self.events()) as events:
                async for choice, event in events:
                    if event.delta is not None and event.delta.logprobs:
                        outputs[choice].logprobs.extend(event.delta.logprobs)
                    if event.result is not None:
                        outputs[choice].result = event.result

        gathering = asyncio.ensure_future(gather())
        disconnect = asyncio.ensure_future(_client_disconnected(request))
        try:
            await asyncio.wait({gathering, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            gathering.cancel()
            await asyncio.gather(gathering, disconnect, return_exceptions=True)
        if gathering.cancelled():
            return None
        gathering.result()
        for output in outputs:
            check_result(output.result)
        return outputs

    def usage(self, results: Sequence[TaskResult]) -> Usage:
        """Token counts of the whole request; a prompt counts once however many samples it has."""
        firsts = [results[p * self.n] for p in range(len(self.streams))]
        return Usage(
            prompt_tokens=sum(r.prompt_tokens for r in firsts),
            completion_tokens=sum(r.completion_tokens for r in results),
            cached_tokens=sum(r.cached_tokens for r in firsts),
        )


def check_result(result: TaskResult) -> None:
    """Raise the API error of a sample that ended without finishing."""
    if result.finish_reason == "error":
        raise APIError(500, f"generation failed: {result.error}")
    if result.finish_reason == "abort":
        reason = result.error or "the server is shutting down"
        raise APIError(503, f"the request was aborted: {reason}")


async def _client_disconnected(request: Request) -> None:
    """Return once the client has gone; the body is already read, so only disconnect remains."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class GenerationService:
    """What the API routers need from the engine: model names, prompts, params, submission."""

    def __init__(self, engine: InferenceEngine, model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.created = int(time.time())

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise APIError(
                404,
                f"the model {requested!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The same encoding as InferenceEngine.generate, so greedy results match it."""
        try:
            return self.engine.encode(GenerationRequest(tuple(messages)))
        except (RequestError, ChatTemplateError) as exc:
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc

    def text_prompt(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def params(
        self, prompts: Sequence[list[int]], max_tokens: int | None, **fields
    ) -> GenerationParams:
        """GenerationParams from request fields (None means the engine's default).

        Without max_tokens a request may generate up to the end of the context.
        """
        if max_tokens is None:
            limit = self.engine.max_request_tokens
            max_tokens = max(1, limit - max(len(p) for p in prompts))
        settings = {k: v for k, v in fields.items() if v is not None}
        try:
            return GenerationParams(max_tokens=max_tokens, **settings)
        except RequestError as exc:
            raise APIError(400, str(exc)) from exc

    def submit(self, prompts: Sequence[list[int]], params: GenerationParams) -> Generation:
        """Queue every prompt, or none: a prompt that cannot fit is refused before any is queued,
        and if the queue fills part-way the ones already queued are aborted."""
        arrival = time.perf_counter()
        streams = []
        try:
            for prompt in prompts:
                self.engine.check_fits(len(prompt), params.max_tokens)
            for prompt in prompts:
                streams.append(self.engine.submit_async(prompt, params))
        except Exception as exc:
            for stream in streams:
                stream.abort()
            raise _api_error(exc) from exc
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        return Generation(streams, params.n, self.metrics, arrival)


def _api_error(exc: Exception) -> Exception:
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, RequestError):
        return APIError(400, str(exc))
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc))
    if isinstance(exc, RuntimeError):
        return APIError(503, f"the engine cannot take requests: {exc}")
    return exc
