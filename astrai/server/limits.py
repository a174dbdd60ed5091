"""Bounds on what one client may cost the server: body size, and time to send a request."""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

from astrai.server.errors import APIError, error_response

log = logging.getLogger(__name__)


class _BodyTooLarge(Exception):
    pass


class RequestBodyLimit:
    """ASGI middleware that reads each request body before the app sees it, within bounds.

    A body over max_bytes is refused with 413 before it is held in memory (at once when its
    Content-Length says so, else as soon as the chunks received pass the limit), and a body not
    received within timeout seconds (a slowloris client) is answered 408. Both responses close the
    connection, so the rest of the body is never read.
    """

    def __init__(self, app, max_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_bytes} bytes; "
            "send a smaller request (the operator sets the limit with --max-request-bytes)",
        )
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > self.max_bytes:
            await _refuse(scope, receive, send, too_large)
            return
        try:
            async with asyncio.timeout(self.timeout):
                body = await self._read_body(receive)
        except _BodyTooLarge:
            await _refuse(scope, receive, send, too_large)
            return
        except TimeoutError:
            message = f"the request body did not arrive within {self.timeout:g} seconds"
            await _refuse(scope, receive, send, APIError(408, message))
            return
        if body is None:  # the client left before sending its body: nobody to answer
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _refuse(scope, receive, send, error: APIError) -> None:
    response = error_response(scope["path"], error)
    response.headers["Connection"] = "close"
    await response(scope, receive, send)


def _replay(body: bytes, receive):
    """A receive that hands the app the body read already, then waits on the client as before."""
    delivered = False

    async def replay():
        nonlocal delivered
        if delivered:
            return await receive()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


class HeaderDeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on every wait for the client.

    uvicorn closes a keep-alive connection left idle, but a client that sends its headers a
    byte at a time, stops halfway, or trickles the leftover body of a refused request holds its
    connection for ever (slowloris). Here a connection on which the app is not handling a request
    is closed header_timeout seconds after it opened or after its last response.
    """

    def __init__(self, *args, header_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._start_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._start_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _start_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.header_timeout, self._on_deadline)

    def _on_deadline(self) -> None:
        handling = self.cycle is not None and not self.cycle.response_complete
        if handling or self.transport.is_closing():
            return
        log.debug("closed a connection that sent no complete request in %gs", self.header_timeout)
        self.transport.close()
