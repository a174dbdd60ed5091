"""The shape the server's ASGI middlewares share (auth, hosts, limits): each admits an HTTP
request or refuses it with an APIError, answered in the API's own error format before the app
sees the request; other scopes (lifespan) pass through."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any

from astrai.server.errors import APIError, error_response

Receive = Callable[[], Awaitable[dict[str, Any]]]


class RequestGate(ABC):
    """ASGI middleware base: admit() passes a request on to the app or raises the APIError it is
    answered with."""

    # Whether a refusal closes the connection, so that the rest of the body is never read.
    closes_on_refusal = False

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            admitted = await self.admit(scope["path"], dict(scope["headers"]), receive)
        except APIError as error:
            response = error_response(scope["path"], error)
            if self.closes_on_refusal:
                response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        if admitted is not None:
            await self.app(scope, admitted, send)

    @abstractmethod
    async def admit(
        self, path: str, headers: dict[bytes, bytes], receive: Receive
    ) -> Receive | None:
        """The receive the app reads the request through (receive itself, or one that replays
        what was read), or None where the client left and nobody is to be answered; raises
        APIError to refuse the request."""
