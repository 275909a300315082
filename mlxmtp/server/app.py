"""The Starlette app: routes, auth, errors in each API's shape, metrics, engine lifecycle."""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine import memory, prefix_disk
from ..engine.batch import BatchGenerator
from ..engine.limits import PREFILL_STEP, PREFIX_DISK_MB
from ..engine.pieces import model_pieces
from ..engine.prefix_cache import default_budget
from ..mlxlm.family import text_parts
from ..models.load import MTPModel
from . import anthropic_api, openai_api, responses_api
from .engine_thread import EngineBridge
from .errors import APIError, error_response, is_anthropic_path
from .metrics import Metrics
from .server_state import ServerState
from .structured_output import serve_tokenizer

log = logging.getLogger("mlxmtp.server")


def create_app(model, tok, *, model_id: Optional[str] = None, enable_mtp: bool = True,
               num_draft: Optional[int] = None, max_concurrent: int = 8, max_prompt_tokens: Optional[int] = None,
               prefix_cache_mb: Optional[float] = 0, api_key: Optional[str] = None, aliases: Sequence[str] = (),
               request_hook: Optional[Callable] = None, context_length: Optional[int] = None,
               max_body_mb: float = 8.0, strict_model_name: bool = False, pipeline_drafts: bool = False,
               compile_steps: bool = False, memory_mb: Optional[int] = None,
               sampling_defaults: Optional[dict] = None, chat_template_args: Optional[dict] = None,
               default_max_tokens: Optional[int] = None, prefill_step: int = PREFILL_STEP,
               allowed_origins: Sequence[str] = (), prefix_cache_entries: Optional[int] = None,
               prefix_cache_dir: Optional[str] = None, prefix_cache_disk_mb: int = PREFIX_DISK_MB,
               constrain_tool_calls: bool = False,
               engine_factory: Callable[..., BatchGenerator] = BatchGenerator) -> Starlette:
    """The ASGI app. `context_length` defaults to the model's max_position_embeddings;
    `sampling_defaults` ({"temperature": ..., "top_p": ...}) fill the sampling fields a
    request leaves unset (None: greedy decoding); `chat_template_args` are the template's
    variables for every request (a request's own win: see ServerState.template_kwargs);
    `default_max_tokens` caps the output of requests that set no limit (None: the context's
    end; completions: 16, as OpenAI's); request bodies over `max_body_mb` MiB get 413;
    `allowed_origins` are the web origins browsers may call it from (CORS; none by default).
    Any model name is answered (under the name asked for) unless `strict_model_name`: then
    only the model id and its aliases. `prefix_cache_dir`: the prefix cache's folder on disk,
    of `prefix_cache_disk_mb` MiB at most (engine/prefix_disk.py; None: memory only).
    `constrain_tool_calls`: every tool call the model opens is held to the tools' grammar
    (call_hold.CallProcessor), not only forced and `strict` ones.
    `engine_factory(model, tok, **engine_options(...))` builds the engine (rank 0 of a
    distributed server passes its own)."""
    _materialize(model)
    mtp_active, reason = _mtp_status(model, enable_mtp)
    metrics = Metrics()
    options = engine_options(model, enable_mtp, num_draft, max_concurrent, prefix_cache_mb, pipeline_drafts,
                             compile_steps, memory_mb, prefill_step, prefix_cache_entries)
    _log_prefix_cache(options["prefix_cache_bytes"], prefix_cache_entries)
    args = text_parts(model).args
    serve_tokenizer(tok, args.vocab_size)  # what response formats are compiled for
    context_length = _context_in_memory(model, mtp_active, context_length or args.max_position_embeddings,
                                        options["memory_bytes"])
    bridge = _watched_bridge(_with_disk(lambda: engine_factory(model, tok, **options), prefix_cache_dir,
                                        prefix_cache_disk_mb), metrics)
    model_id = model_id or "mlxmtp-demo"
    state = ServerState(tok=tok, model_id=model_id, bridge=bridge, metrics=metrics, eos_ids=set(tok.eos_token_ids),
                        mtp_active=mtp_active, mtp_disabled_reason=reason, vocab_size=args.vocab_size,
                        context_length=context_length, max_prompt_tokens=max_prompt_tokens,
                        aliases=_served_aliases(model_id, aliases),
                        request_hook=request_hook, strict_model_name=strict_model_name,
                        sampling_defaults=dict(sampling_defaults or {}),
                        chat_template_args=dict(chat_template_args or {}), default_max_tokens=default_max_tokens,
                        constrain_tool_calls=constrain_tool_calls)
    return _outer_app(state, api_key, max_body_mb, allowed_origins)


def _outer_app(state: ServerState, api_key: Optional[str], max_body_mb: float, allowed_origins: Sequence[str]):
    """The routes of `state`, its engine running while they serve, behind what every
    request passes first (_Outer: CORS, the API key, the body limit)."""
    app = Starlette(routes=_routes(state), lifespan=functools.partial(_engine_running, state.bridge),
                    exception_handlers=_EXCEPTION_HANDLERS)
    app.state.server = state
    return _Outer(app, state, api_key, int(max_body_mb * 2**20), allowed_origins)


@contextlib.asynccontextmanager
async def _engine_running(bridge: EngineBridge, app):
    """The app's lifespan: the engine thread runs while the server does."""
    bridge.start()
    try:
        yield
    finally:
        bridge.stop()


def _log_prefix_cache(budget: int, entries: Optional[int]) -> None:
    log.info("prefix cache: up to %s%s", f"{budget >> 20} MiB" if budget >= 2**20 or not budget else f"{budget} bytes",
             f", {entries} entries" if entries else "")


def _watched_bridge(make_engine: Callable[[], BatchGenerator], metrics: Metrics) -> EngineBridge:
    """The bridge to the engine `make_engine` builds, its prefix cache and memory in `metrics`."""
    bridge = EngineBridge(make_engine, metrics)
    metrics.watch_prefix_cache(lambda: bridge.engine.prefix_cache if bridge.engine is not None else None)
    metrics.watch_memory(lambda: bridge.engine.memory if bridge.engine is not None else None)
    return bridge


def _with_disk(make_engine: Callable[[], BatchGenerator], folder: Optional[str], disk_mb: int):
    """`make_engine`, whose engines keep prefix cache entries in `folder` too (if given)."""
    if not folder:
        return make_engine

    def make() -> BatchGenerator:
        engine = make_engine()
        prefix_disk.attach(engine, Path(folder), disk_mb << 20)
        return engine

    return make


def engine_options(model, enable_mtp: bool, num_draft: Optional[int], max_concurrent: int,
                   prefix_cache_mb: Optional[float], pipeline_drafts: bool, compile_steps: bool = False,
                   memory_mb: Optional[int] = None, prefill_step: int = PREFILL_STEP,
                   prefix_cache_entries: Optional[int] = None) -> dict:
    """The server's engine settings (every rank of a distributed server builds its engine
    from these); `prefix_cache_mb` (MiB, 2**20 bytes; a fraction for a budget in bytes:
    `serve --prompt-cache-bytes`), `memory_mb` None: the machine's defaults
    (prefix_cache.default_budget, memory.default_budget); `prefill_step`: prompt tokens a
    prefill chunk takes; `prefix_cache_entries`: the most entries the prefix cache holds
    (None: its bytes alone bound it)."""
    weights = _weight_bytes(model)
    budget = default_budget(weights) if prefix_cache_mb is None else int(prefix_cache_mb * 2**20)
    caches = memory.default_budget(weights) if memory_mb is None else int(memory_mb) * 2**20
    return dict(enable_mtp=_mtp_status(model, enable_mtp)[0], num_draft=num_draft, max_batch=max_concurrent,
                prefix_cache_bytes=budget, pipeline_drafts=pipeline_drafts, compile_steps=compile_steps,
                memory_bytes=caches, prefill_step=prefill_step, prefix_cache_entries=prefix_cache_entries)


def _context_in_memory(model, mtp: bool, context_length: int, memory_bytes: int) -> int:
    """The context length, capped at what one request's caches can reach in `memory_bytes`
    (0: unbounded): a longer prompt then gets the API's "prompt is too long" 400."""
    if memory_bytes <= 0:
        log.info("memory for running requests: unbounded (--memory-mb 0, or the weights leave nothing "
                 "under the device's limit)")
        return context_length
    fits = memory.measure(model_pieces(model, mtp)).max_positions(memory_bytes)
    if fits >= context_length:  # the context bounds a request, not memory: say which does
        alone = f"up to {context_length} tokens, the context length (memory would hold {_tokens(fits)})"
    else:
        alone = f"up to {fits} tokens, what its caches can reach in memory"
    log.info("memory for running requests and the prefix cache: %d MiB; one request alone: %s",
             memory_bytes >> 20, alone)
    if fits < context_length:
        log.warning("context length %d capped at %d tokens: what one request's caches can reach in memory",
                    context_length, fits)
    return min(context_length, fits)


def _tokens(n: int) -> str:
    """A token count as a reader takes it in: 19.7M, 350K, 4096."""
    if n >= 10**6:
        return f"{n / 10**6:.1f}M"
    return f"{n / 10**3:.0f}K" if n >= 10**5 else str(n)


def _mtp_status(model, enable_mtp: bool) -> Tuple[bool, Optional[str]]:
    """-> (whether the server drafts with the MTP head, why not when it does not)."""
    if enable_mtp and isinstance(model, MTPModel) and model.active:
        return True, None
    if not isinstance(model, MTPModel):
        return False, "no MTP head"
    return False, model.disabled_reason or "disabled by the server options"


def _served_aliases(model_id: str, aliases: Sequence[str]) -> set:
    names = set(aliases)
    if "/" in model_id or Path(model_id).name != model_id:
        names.add(Path(model_id).name)  # a local path also answers to its folder name
    return names


def _routes(state: ServerState) -> List[Route]:
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


_EXCEPTION_HANDLERS = {APIError: _api_error, HTTPException: _http_error, Exception: _server_error}


def _weights(model) -> list:
    """The model's parameters and its MTP head's (which `model.parameters()` leaves out)."""
    arrays = [model.parameters()]
    if isinstance(model, MTPModel) and model.head is not None:
        arrays.append(model.head.parameters())
    return arrays


def _weight_bytes(model) -> int:
    return sum(a.nbytes for _, a in tree_flatten(_weights(model)))


def _materialize(model) -> None:
    """Evaluate every weight here, so no lazy graph recorded on this thread's MLX stream
    reaches the engine thread (streams are per thread)."""
    mx.eval(_weights(model))


class _Outer:
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
__all__ = ["create_app", "ServerState", "is_anthropic_path"]
