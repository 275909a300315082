"""`ServerConfig`: everything the HTTP server is built from besides its engine's config
(engine/config.py), in one frozen object the command line makes once (commands/serve.py).

A module without MLX or Starlette, so the command line can build one before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

from ..engine.config import EngineConfig

# The engine create_app runs when given none: serve's 8 requests decoded together, the
# machine's memory budget and suffix drafts beside the head; no prefix cache.
SERVED_ENGINE = EngineConfig(max_batch=8, memory_bytes=None, suffix_drafts=True)


@dataclass(frozen=True)
class ServerConfig:
    # The served model's name (/v1/models); other names (aliases, "*": any) it answers to,
    # and whether a name it does not know gets 404 rather than the served model.
    model_id: str = "mlxmtp-demo"
    aliases: Tuple[str, ...] = ()
    strict_model_name: bool = False
    # Where it listens, and how long open streams may run after a signal to stop.
    host: str = "127.0.0.1"
    port: int = 8080
    shutdown_timeout: float = 10.0
    log_level: str = "info"
    # What every request passes first: the API key (None: none needed), the largest body
    # (MiB; 413 beyond), the web origins browsers may call from (CORS; none by default).
    api_key: Optional[str] = None
    max_body_mb: float = 8.0
    allowed_origins: Tuple[str, ...] = ()
    # Limits: prompt tokens (400 beyond; None: none), prompt + output tokens (None: the
    # model's max_position_embeddings, capped at what memory holds).
    max_prompt_tokens: Optional[int] = None
    context_length: Optional[int] = None
    # What a request leaves unset: its output limit (None: the context's end; completions
    # 16, as OpenAI's), its sampling fields ({"temperature": ..., ...}; none: greedy), the
    # chat template's variables (a request's own win: ServerState.template_kwargs).
    default_max_tokens: Optional[int] = None
    sampling_defaults: dict = field(default_factory=dict)
    chat_template_args: dict = field(default_factory=dict)
    # Every tool call the model opens held to the tools' grammar (call_hold.CallProcessor),
    # not only forced and `strict` ones.
    constrain_tool_calls: bool = False
