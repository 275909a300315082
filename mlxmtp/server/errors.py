"""Errors as part of the interface: one exception type, rendered in each API's own shape.

Handlers raise `APIError`; the app turns it into OpenAI's
`{"error": {"message", "type", "param", "code"}}` or Anthropic's
`{"type": "error", "error": {"type", "message"}}` depending on the route, so a
client library always gets an error it knows how to raise.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from starlette.responses import JSONResponse

# Anthropic names its error types by status; OpenAI mostly says invalid_request_error.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
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


# ------------------------------------------------------------------ request validation
# Plain functions rather than pydantic models: the two APIs differ in details (names,
# ranges, defaults) and these few checks keep every message pointing at the field.

_MISSING = object()


def parse_json_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"")
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"invalid JSON body: {e}") from e
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _type_name(types) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(names.get(t, t.__name__) for t in types)


def field(body: dict, name: str, types, *, required: bool = False, default: Any = None,
          minimum: Optional[float] = None, maximum: Optional[float] = None,
          exclusive_minimum: bool = False) -> Any:
    """Fetch `name` from `body`, checking type and range; None counts as absent."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise APIError(400, f"'{name}' is a required field", param=name)
        return default
    types = types if isinstance(types, tuple) else (types,)
    # bool is an int in Python; JSON true is not a number. Ints are fine where floats are.
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok and float in types and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise APIError(400, f"'{name}' must be of type {_type_name(types)}, got {json.dumps(value)[:80]}",
                       param=name)
    if minimum is not None:
        if value < minimum or (exclusive_minimum and value == minimum):
            cmp = ">" if exclusive_minimum else ">="
            raise APIError(400, f"'{name}' must be {cmp} {minimum}, got {value}", param=name)
    if maximum is not None and value > maximum:
        raise APIError(400, f"'{name}' must be <= {maximum}, got {value}", param=name)
    return value


def string_list(body: dict, name: str) -> list:
    """A stop field: a string or a list of strings."""
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise APIError(400, f"'{name}' must be a string or an array of strings", param=name)
