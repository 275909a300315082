"""What every request passes first, around the app's routes: CORS, the API key, the
request body limit and per-endpoint request counting."""

from __future__ import annotations

import hmac
from typing import Callable, Optional, Sequence

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware

from .errors import APIError, error_response
from .server_state import ServerState


class OuterApp:
    """Pure ASGI wrapper (not BaseHTTPMiddleware, which breaks streaming disconnects):
    CORS (Starlette's middleware, outermost: a browser's preflight carries no API key),
    API-key check, the request body limit and per-endpoint request counting."""

    def __init__(self, app: Starlette, state: ServerState, api_key: Optional[str], max_body: int,
                 allowed_origins: Sequence[str] = ()):
        self.app = app
        self.state = app.state  # tests and tools reach the ServerState as app.state.server
        self.api_key = api_key
        self.max_body = max_body
        self.entry = self._guarded
        if allowed_origins:
            self.entry = CORSMiddleware(self._guarded, allow_origins=list(allowed_origins), allow_methods=["*"],
                                        allow_headers=["*"], expose_headers=["x-mlxmtp-warning"], max_age=600)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        await self.entry(scope, receive, send)

    async def _guarded(self, scope, receive, send):
        path = scope["path"]
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self.api_key and path not in ("/health", "/") and not self._authorized(scope):
                err = APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                               code="invalid_api_key")
                await error_response(err, path)(scope, receive, send_wrapper)
                return
            if self._declared_length(scope) > self.max_body:
                await error_response(self._too_large(), path)(scope, receive, send_wrapper)
                return
            await self.app(scope, _limited(receive, self.max_body, self._too_large), send_wrapper)
        finally:
            endpoint = path if path in _ENDPOINTS else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
            self.state.server.metrics.requests.labels(endpoint, str(status["code"])).inc()

    def _too_large(self) -> APIError:
        return APIError(413, f"request body larger than {self.max_body // 2**20} MiB (--max-body-mb)",
                        code="request_too_large")

    @staticmethod
    def _declared_length(scope) -> int:
        for k, v in scope.get("headers", []):
            if k.lower() == b"content-length":
                try:
                    return int(v)
                except ValueError:
                    return 0
        return 0

    def _authorized(self, scope) -> bool:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-api-key")
        auth = headers.get("authorization", "")
        if given is None and auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        return given is not None and hmac.compare_digest(given.encode(), self.api_key.encode())


def _limited(receive, limit: int, error: Callable[[], APIError]):
    """`receive` that raises once the body passes `limit` bytes (a chunked body declares
    no length); the app's handler turns the APIError into a 413."""
    seen = 0

    async def wrapped():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise error()
        return message

    return wrapped


_ENDPOINTS = {"/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/messages",
              "/v1/messages/count_tokens", "/v1/responses", "/"}
