"""Errors as part of the interface: one exception type, rendered in each API's own shape.

Handlers raise `APIError`; the app turns it into OpenAI's
`{"error": {"message", "type", "param", "code"}}` or Anthropic's
`{"type": "error", "error": {"type", "message"}}` depending on the route, so a
client library always gets an error it knows how to raise.
"""

from __future__ import annotations

from typing import Optional

from starlette.responses import JSONResponse

# Anthropic names its error types by status; OpenAI mostly says invalid_request_error.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    405: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
_OPENAI_TYPES = {401: "authentication_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def openai_error_body(err: APIError) -> dict:
    return {"error": {"message": err.message, "type": _OPENAI_TYPES.get(err.status, "invalid_request_error"),
                      "param": err.param, "code": err.code}}


def anthropic_error_body(err: APIError) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(err.status, "api_error"), "message": err.message}}


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(err: APIError, path: str) -> JSONResponse:
    body = anthropic_error_body(err) if is_anthropic_path(path) else openai_error_body(err)
    return JSONResponse(body, status_code=err.status)
