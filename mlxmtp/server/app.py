"""The Starlette app assembled: its engine (on a thread, behind the bridge), its state,
routes (routes.py) and what every request passes first (outer.py), from a ServerConfig
and an EngineConfig (config.py)."""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

import mlx.core as mx
from starlette.applications import Starlette

from ..engine import budgets, memory
from ..engine.build import build_engine
from ..engine.config import EngineConfig
from ..engine.interface import Engine
from ..engine.pieces import model_pieces
from ..mlxlm.family import text_parts
from ..models.mtp_model import MTPModel
from .config import SERVED_ENGINE, ServerConfig
from .engine_thread import EngineBridge
from .errors import is_anthropic_path
from .metrics import Metrics
from .outer import OuterApp
from .routes import EXCEPTION_HANDLERS, routes
from .server_state import ServerState
from .structured_output import serve_tokenizer

log = logging.getLogger("mlxmtp.server")


def create_app(model, tok, server: ServerConfig = ServerConfig(), engine: EngineConfig = SERVED_ENGINE, *,
               request_hook: Optional[Callable] = None,
               engine_factory: Callable[..., Engine] = build_engine) -> OuterApp:
    """The ASGI app serving `model` as `server` says, on the engine
    `engine_factory(model, tok, engine)` builds on the engine thread (rank 0 of a
    distributed server passes its own; every other rank builds its engine from the same
    `engine`). The context length is capped at what one request's caches can reach in the
    engine's memory budget; `request_hook` (tests) sees every request before it runs."""
    _materialize(model)
    mtp_active, reason = _mtp_status(model, engine.enable_mtp)
    metrics = Metrics()
    taken = budgets.resolved(model, engine)  # the bytes the engine will take
    _log_prefix_cache(taken.prefix_cache_bytes, engine.prefix_cache_entries)
    args = text_parts(model).args
    serve_tokenizer(tok, args.vocab_size)  # what response formats are compiled for
    context_length = _context_in_memory(model, mtp_active, server.context_length or args.max_position_embeddings,
                                        taken.memory_bytes)
    bridge = _watched_bridge(lambda: engine_factory(model, tok, engine), metrics)
    state = ServerState(tok=tok, model_id=server.model_id, bridge=bridge, metrics=metrics,
                        eos_ids=set(tok.eos_token_ids), mtp_active=mtp_active, mtp_disabled_reason=reason,
                        vocab_size=args.vocab_size, context_length=context_length,
                        max_prompt_tokens=server.max_prompt_tokens,
                        aliases=_served_aliases(server.model_id, server.aliases), request_hook=request_hook,
                        strict_model_name=server.strict_model_name, sampling_defaults=dict(server.sampling_defaults),
                        chat_template_args=dict(server.chat_template_args),
                        default_max_tokens=server.default_max_tokens,
                        constrain_tool_calls=server.constrain_tool_calls)
    return _outer_app(state, server.api_key, server.max_body_mb, server.allowed_origins)


def _outer_app(state: ServerState, api_key: Optional[str], max_body_mb: float, allowed_origins: Sequence[str]):
    """The routes of `state`, its engine running while they serve, behind what every
    request passes first (OuterApp: CORS, the API key, the body limit)."""
    app = Starlette(routes=routes(state), lifespan=functools.partial(_engine_running, state.bridge),
                    exception_handlers=EXCEPTION_HANDLERS)
    app.state.server = state
    return OuterApp(app, state, api_key, int(max_body_mb * 2**20), allowed_origins)


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


def _watched_bridge(make_engine: Callable[[], Engine], metrics: Metrics) -> EngineBridge:
    """The bridge to the engine `make_engine` builds, its prefix cache, memory and suffix index
    in `metrics`."""
    bridge = EngineBridge(make_engine, metrics)
    metrics.watch_prefix_cache(lambda: bridge.engine.prefix_cache if bridge.engine is not None else None)
    metrics.watch_memory(lambda: bridge.engine.memory if bridge.engine is not None else None)
    metrics.watch_suffix_index(lambda: getattr(getattr(bridge.engine, "proposer", None), "shared_index", None))
    return bridge


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


def _materialize(model) -> None:
    """Evaluate every weight here, so no lazy graph recorded on this thread's MLX stream
    reaches the engine thread (streams are per thread)."""
    mx.eval(budgets.weights(model))


__all__ = ["create_app", "ServerState", "ServerConfig", "is_anthropic_path"]
