"""What `serve` logs and checks once the model is loaded, before the app is built: what is
served and how, what a request that leaves a field unset gets, and whether the chat
template given renders a conversation."""

from __future__ import annotations

import logging
from typing import Optional

from ..models import demo
from ..models.generation_config import recommended_sampling

log = logging.getLogger("mlxmtp.server")


def log_start(model: Optional[str], m, num_draft: Optional[int], host: str, api_key: Optional[str],
              default_max_tokens: Optional[int], demo_default: bool) -> None:
    """What is served, how, the output limit of requests that set none, and a warning when
    anyone on the network could use it."""
    log.info("model: %s", f"packaged demo model ({demo.NAME})" if demo.names_demo(model) else model)
    if m.active:
        log.info("MTP head: active (%s, %d layer(s)); draft depth %s", m.source.location if m.source else "?",
                 max(1, m.info.get("num_layers", 1)), num_draft if num_draft is not None else "adaptive")
    else:
        log.info("MTP head: inactive (%s)", m.disabled_reason or "not requested")
    _log_output_limit(default_max_tokens, demo_default)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("binding %s without --api-key: anyone who can reach it can use the model", host)


def _log_output_limit(default_max_tokens: Optional[int], demo_default: bool) -> None:
    """What a request that sets no output limit gets."""
    if demo_default:
        log.info("output of a request that sets no max_tokens: up to %d tokens, the demo model's default "
                 "(--max-tokens N sets another)", default_max_tokens)
    elif default_max_tokens is not None:
        log.info("output of a request that sets no max_tokens: up to %d tokens (--max-tokens)", default_max_tokens)
    else:
        log.info("output of a request that sets no max_tokens: to the end of its turn or of the context "
                 "(completions: 16; --max-tokens N caps it)")


def check_changes(tok, adapter_path, chat_template: Optional[str], chat_template_args: dict) -> None:
    """Log what the options change of the model as its folder has it; raise ValueError for
    a chat template that cannot render a one-message conversation now, not at the first
    request."""
    if adapter_path is not None:
        log.info("adapters: %s", adapter_path)
    if chat_template is None and not chat_template_args:
        return
    if getattr(tok, "chat_template", None) is not None:
        try:
            text = tok.apply_chat_template([{"role": "user", "content": "a user's words"}], tokenize=False,
                                           add_generation_prompt=True, **chat_template_args)
        except Exception as e:  # noqa: BLE001 - Jinja's syntax and runtime errors alike
            raise ValueError(f"the chat template cannot render a conversation: {e}") from e
        if "a user's words" not in text:
            raise ValueError("the chat template leaves a conversation's messages out of the prompt")
    log.info("chat template: %s; variables for every request: %s",
             "--chat-template" if chat_template is not None else "the model's", chat_template_args or "none")


def sampling_defaults(m, **options) -> dict:
    """What a request that leaves a sampling field unset gets: the option given, else the
    model's generation_config.json (models/generation_config.py), else greedy decoding."""
    recommended = recommended_sampling(getattr(m, "model_dir", None))
    defaults = {**recommended, **{k: v for k, v in options.items() if v is not None}}
    log.info("sampling fields a request leaves unset: %s",
             ", ".join(f"{k} {v}" for k, v in defaults.items()) or "greedy decoding")
    return defaults
