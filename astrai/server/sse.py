"""Streamed responses (server-sent events, Ollama's NDJSON) that always close their event
source."""

from __future__ import annotations

import json

from starlette.responses import StreamingResponse


def sse_data(body: dict | str) -> str:
    """One `data:` event (OpenAI style); strings such as [DONE] go out as they are."""
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


def sse_event(kind: str, data: dict) -> str:
    """One named event whose data carries its type too (Anthropic style)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def ndjson_line(body: dict) -> str:
    """One line of a newline-delimited JSON stream (Ollama style)."""
    return json.dumps(body) + "\n"


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that closes its async generator however the stream ends.

    Starlette cancels the sending task when the client disconnects but leaves the generator
    suspended; closing it runs its cleanup, which aborts the request in the engine at once.
    """

    media_type = "text/event-stream"

    def __init__(self, events) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class NDJSONResponse(EventStreamResponse):
    """A newline-delimited JSON stream, closed like an event stream."""

    media_type = "application/x-ndjson"
