"""The app's routes, and its errors in the shape of the API each path belongs to."""

from __future__ import annotations

import logging
from typing import List

from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import anthropic_api, openai_api, responses_api
from .errors import APIError, error_response
from .server_state import ServerState

log = logging.getLogger("mlxmtp.server")


def routes(state: ServerState) -> List[Route]:
    bridge = state.bridge

    async def health(request: HTTPRequest):
        return JSONResponse({"status": "ok", "model": state.model_id, "mtp_active": state.mtp_active,
                             "active": bridge.num_active, "waiting": bridge.num_waiting,
                             "engine_restarts": bridge.restarts})

    async def root(request: HTTPRequest):  # clients probe GET / and HEAD /
        return JSONResponse({"status": "ok", "server": "mlxmtp", "model": state.model_id})

    async def metrics_endpoint(request: HTTPRequest):
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    return [
        Route("/", root, methods=["GET", "HEAD"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/v1/models", openai_api.list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", openai_api.get_model, methods=["GET"]),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/responses", responses_api.responses, methods=["POST"]),
        Route("/v1/messages", anthropic_api.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic_api.count_tokens, methods=["POST"]),
    ]


# Errors in the shape of the API the path belongs to.
async def _api_error(request: HTTPRequest, exc: APIError):
    return error_response(exc, request.url.path)


async def _http_error(request: HTTPRequest, exc: HTTPException):
    return error_response(APIError(exc.status_code, str(exc.detail)), request.url.path)


async def _server_error(request: HTTPRequest, exc: Exception):
    log.exception("unhandled error on %s", request.url.path)
    return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"), request.url.path)


EXCEPTION_HANDLERS = {APIError: _api_error, HTTPException: _http_error, Exception: _server_error}
