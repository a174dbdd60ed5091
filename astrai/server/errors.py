"""Errors the HTTP APIs return, rendered in the shape of the API that was called."""

from __future__ import annotations

from fastapi.responses import JSONResponse

# Client closed the connection before the response (nginx's convention); seen only in metrics.
CLIENT_CLOSED = 499

# A 503 asks the client to come back: the queue is full or the server is shutting down.
RETRY_AFTER_SECONDS = 1

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    499: "client_closed_request",
    503: "service_unavailable_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    499: "client_closed_request",
    503: "overloaded_error",
}


class APIError(Exception):
    """A request the server answers with an error status and a message saying what was wrong."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def is_ollama_path(path: str) -> bool:
    return path.startswith("/api/")


def ollama_error_body(message: str) -> dict:
    return {"error": message}


def openai_error_body(status: int, message: str, param: str | None, code: str | None) -> dict:
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(path: str, error: APIError) -> JSONResponse:
    """The JSON error response for an API error, in the shape of the API the path belongs to."""
    if is_anthropic_path(path):
        body = anthropic_error_body(error.status, error.message)
    elif is_ollama_path(path):
        body = ollama_error_body(error.message)
    else:
        body = openai_error_body(error.status, error.message, error.param, error.code)
    headers = {}
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if error.status == 503:
        headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return JSONResponse(body, status_code=error.status, headers=headers)
