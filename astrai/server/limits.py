"""Bounds on what one client may cost the server: body size, time to send a request, and
requests whose framing a proxy in front could read otherwise (request smuggling)."""

from __future__ import annotations

import asyncio
import logging
import re

import h11
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from astrai.server.errors import APIError
from astrai.server.middleware import Receive, RequestGate

log = logging.getLogger(__name__)


class _BodyTooLarge(Exception):
    pass


class RequestBodyLimit(RequestGate):
    """ASGI middleware that reads each request body before the app sees it, within bounds.

    A body over max_bytes is refused with 413 before it is held in memory (at once when its
    Content-Length says so, else as soon as the chunks received pass the limit), and a body not
    received within timeout seconds (a slowloris client) is answered 408. Both responses close the
    connection, so the rest of the body is never read.
    """

    closes_on_refusal = True

    def __init__(self, app, max_bytes: int, timeout: float) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def admit(
        self, path: str, headers: dict[bytes, bytes], receive: Receive
    ) -> Receive | None:
        too_large = APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_bytes} bytes; "
            "send a smaller request (the operator sets the limit with --max-request-bytes)",
        )
        declared = headers.get(b"content-length")
        if declared is not None and int(declared) > self.max_bytes:
            raise too_large
        try:
            async with asyncio.timeout(self.timeout):
                body = await self._read_body(receive)
        except _BodyTooLarge:
            raise too_large from None
        except TimeoutError:
            message = f"the request body did not arrive within {self.timeout:g} seconds"
            raise APIError(408, message) from None
        if body is None:  # the client left before sending its body: nobody to answer
            return None
        return _replay(body, receive)

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


# The end of a request's head: its blank line, as h11 finds it.
_HEAD_END = re.compile(rb"\n\r?\n")


def framing_problem(head: bytes) -> str | None:
    """What makes a request head's framing ambiguous, or None. h11 refuses conflicting
    Content-Length values and any Transfer-Encoding but chunked, and lets two kinds through:
    Content-Length beside Transfer-Encoding (it reads the chunks and keeps the connection, so
    the bytes a proxy that went by Content-Length took for the next request are answered as
    one), and header lines folded onto the next (obs-fold), which it joins where a proxy may
    not. RFC 9112 lets a server refuse both; here they are."""
    lines = head.lstrip(b"\r\n").split(b"\n")[1:]
    if any(line[:1] in (b" ", b"\t") for line in lines):
        return "a header line continues the one before it (obs-fold); send each header on one line"
    names = {line.split(b":", 1)[0].strip().lower() for line in lines}
    if {b"content-length", b"transfer-encoding"} <= names:
        return "the request has both Content-Length and Transfer-Encoding; send one of them"
    return None


class _StrictFramingConnection(h11.Connection):
    """h11's server side that refuses the request heads framing_problem finds, before h11
    reads them, as a RemoteProtocolError: uvicorn answers 400 and closes the connection."""

    refusal: str | None = None

    def next_event(self):
        if self.their_state is h11.IDLE:
            buffered = self.trailing_data[0]
            end = _HEAD_END.search(buffered)
            if end is not None:
                self.refusal = framing_problem(buffered[: end.start()])
                if self.refusal is not None:
                    raise h11.RemoteProtocolError(self.refusal, error_status_hint=400)
        return super().next_event()


class StrictH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, strict about framing and with a deadline on every wait for the
    client.

    A request whose framing is ambiguous (framing_problem) is answered 400 with the reason,
    and its connection closed: nothing sent after it on that connection is read.

    uvicorn closes a keep-alive connection left idle, but a client that sends its headers a
    byte at a time, stops halfway, or trickles the leftover body of a refused request holds its
    connection for ever (slowloris). Here a connection on which the app is not handling a request
    is closed header_timeout seconds after it opened or after its last response.
    """

    def __init__(self, *args, header_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        size = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        self.conn = _StrictFramingConnection(h11.SERVER, size)
        self.header_timeout = header_timeout
        self._deadline: asyncio.TimerHandle | None = None

    def send_400_response(self, msg: str) -> None:
        super().send_400_response(self.conn.refusal or msg)

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
