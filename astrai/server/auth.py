"""API-key check for every endpoint but the probes; accepts OpenAI's header (which Ollama's
clients send too) and Anthropic's."""

from __future__ import annotations

import hmac

from astrai.server.errors import APIError, error_response

# Load balancers and Prometheus probe these without a key.
PUBLIC_PATHS = frozenset({"/health", "/metrics"})


def _presented_key(headers: dict[bytes, bytes]) -> bytes | None:
    authorization = headers.get(b"authorization", b"")
    if authorization[:7].lower() == b"bearer ":
        return authorization[7:].strip()
    return headers.get(b"x-api-key")


class APIKeyAuth:
    """ASGI middleware: a request must carry `Authorization: Bearer KEY` or `x-api-key: KEY`.

    It runs before routing and body parsing, so a bad key is refused whatever the body holds.
    Only /health and /metrics are public; the API docs, when served, need the key too.
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            presented = _presented_key(dict(scope["headers"]))
            if presented is None:
                error = APIError(
                    401,
                    "missing API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                    code="invalid_api_key",
                )
            elif not hmac.compare_digest(presented, self.api_key):
                error = APIError(401, "invalid API key", code="invalid_api_key")
            else:
                error = None
            if error is not None:
                await error_response(scope["path"], error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
