"""Serving until a signal, then a graceful stop: drain the running requests, end the rest."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import socket

import uvicorn

from astrai.server import defaults
from astrai.server.errors import APIError, error_response
from astrai.server.limits import StrictH11Protocol
from astrai.server.registry import ModelRegistry

log = logging.getLogger(__name__)

# How long requests get to send their error endings once they are stopped, before uvicorn cancels
# what is left.
_STOPPED_REQUESTS_TIMEOUT = 5.0


class Drain:
    """The shutdown state of one app: how many requests are in flight, whether to take more.

    DrainGate counts the requests; run() refuses new ones, waits for the running ones and
    stops those still running when the grace period ends.
    """

    def __init__(self, models: ModelRegistry) -> None:
        self.models = models
        self.draining = False
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def run(self, grace: float) -> None:
        """Refuse new requests, give the running ones grace seconds, then end the rest."""
        self.draining = True
        if self.in_flight:
            log.info("shutting down: waiting up to %gs for %d requests", grace, self.in_flight)
        if not await self._wait_idle(grace):
            log.warning(
                "shutting down: %d requests still running after %gs end with an error",
                self.in_flight,
                grace,
            )
            self.stop_running()
            await self._wait_idle(_STOPPED_REQUESTS_TIMEOUT)

    def stop_running(self) -> None:
        """End every running generation now, each with an error saying the server stops, and
        load no more models."""
        self.models.stop_running()

    async def _wait_idle(self, seconds: float) -> bool:
        try:
            async with asyncio.timeout(seconds):
                await self.idle.wait()
        except TimeoutError:
            return False
        return True


class DrainGate:
    """ASGI middleware: counts requests in flight; once draining, answers new ones 503."""

    def __init__(self, app, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        drain = self.drain
        if drain.draining:
            error = APIError(503, "the server is shutting down and takes no new requests")
            await error_response(scope["path"], error)(scope, receive, send)
            return
        drain.in_flight += 1
        drain.idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            drain.in_flight -= 1
            if not drain.in_flight:
                drain.idle.set()


class _DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGINT or SIGTERM drains before exiting and a second one stops
    the running requests at once; the process then exits normally instead of re-raising it."""

    def __init__(self, config: uvicorn.Config, drain: Drain, grace: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.grace = grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # A signal handler runs between two bytecodes of the loop's thread: hand over to the loop.
        if self._loop is None or not self.started:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._on_signal, signal.Signals(sig).name)

    def _on_signal(self, name: str) -> None:
        if self._draining is None:
            log.info("%s: shutting down gracefully (a second signal stops requests now)", name)
            self._draining = asyncio.ensure_future(self._drain_then_exit())
        else:
            log.info("%s again: stopping the running requests now", name)
            self.drain.stop_running()

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run(self.grace)
        finally:
            self.should_exit = True


def run_server(
    app,
    host: str,
    port: int,
    *,
    shutdown_timeout: float = defaults.SHUTDOWN_TIMEOUT,
    header_timeout: float = defaults.READ_TIMEOUT,
    sock: socket.socket | None = None,
) -> None:
    """Serve app (from create_app) until SIGINT or SIGTERM, then drain it and return.

    sock, a socket already bound to host:port, is served instead of binding one here: the CLI
    binds before it loads the model, so a busy port fails at once.

    Draining refuses new requests with 503, lets running ones finish for shutdown_timeout
    seconds and ends the rest with an error they can read (an SSE error event or a JSON error).
    """
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=functools.partial(StrictH11Protocol, header_timeout=header_timeout),
        timeout_graceful_shutdown=_STOPPED_REQUESTS_TIMEOUT,
    )
    _DrainingServer(config, app.state.drain, shutdown_timeout).run(
        sockets=None if sock is None else [sock]
    )
