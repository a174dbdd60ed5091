"""API-key check for every endpoint but the probes; accepts OpenAI's header (which Ollama's
clients send too) and Anthropic's."""

from __future__ import annotations

import hmac

from astrai.server.errors import APIError
from astrai.server.middleware import Receive, RequestGate

# Load balancers and Prometheus probe these without a key.
PUBLIC_PATHS = frozenset({"/health", "/metrics"})
# The chat page and the folder of its static files (app.py serves them there).
WEBUI_PAGE = "/"
WEBUI_FILES = "/webui/"


def _presented_key(headers: dict[bytes, bytes]) -> bytes | None:
    authorization = headers.get(b"authorization", b"")
    if authorization[:7].lower() == b"bearer ":
        return authorization[7:].strip()
    return headers.get(b"x-api-key")


class APIKeyAuth(RequestGate):
    """ASGI middleware: a request must carry `Authorization: Bearer KEY` or `x-api-key: KEY`.

    It runs before routing and body parsing, so a bad key is refused whatever the body holds.
    Only /health and /metrics are public, and, where the chat page is served (webui), the page
    and its static files: a browser's navigation cannot send the key, and they hold nothing
    secret; the page asks for the key and sends it with every API call. The API docs, when
    served, need the key too.
    """

    def __init__(self, app, api_key: str, webui: bool = False) -> None:
        super().__init__(app)
        self.api_key = api_key.encode()
        self.webui = webui

    def is_public(self, path: str) -> bool:
        if path in PUBLIC_PATHS:
            return True
        return self.webui and (path == WEBUI_PAGE or path.startswith(WEBUI_FILES))

    async def admit(self, path: str, headers: dict[bytes, bytes], receive: Receive) -> Receive:
        if self.is_public(path):
            return receive
        presented = _presented_key(headers)
        if presented is None:
            raise APIError(
                401,
                "missing API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                code="invalid_api_key",
            )
        if not hmac.compare_digest(presented, self.api_key):
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return receive
