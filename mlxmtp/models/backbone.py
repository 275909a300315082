"""The model and tokenizer as mlx-lm loads them, before the head is attached: mlx-lm's
failures as one-line errors, and its server's tokenizer options and memory warning."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import mlx.nn as nn
from mlx.utils import tree_flatten

from ..mlxlm import loading
from .errors import ModelLoadError, MTPLoadError

log = logging.getLogger("mlxmtp")


def load_backbone(model_dir: Path, pipeline, lazy: bool, chat_template: Optional[str], adapter_path,
                  trust_remote_code: bool = False):
    """(model, tokenizer) as mlx-lm loads them; what mlx-lm fails on (a config it cannot
    read, weights cut short, a model type it does not know) is a one-line ModelLoadError."""
    # The tokenizer's settings, as mlx-lm's server gives them (transformers' from_pretrained).
    tokenizer_config = {"chat_template": chat_template} if chat_template is not None else {}
    if trust_remote_code:
        tokenizer_config["trust_remote_code"] = True
    tokenizer_config = tokenizer_config or None
    try:
        if pipeline is not None:
            return loading.load_pipelined(model_dir, *pipeline, tokenizer_config=tokenizer_config)
        return loading.load(model_dir, lazy=lazy, tokenizer_config=tokenizer_config, adapter_path=adapter_path)
    except loading.AdapterError as e:
        raise MTPLoadError(str(e)) from e
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # RuntimeError: MLX's safetensors reader
        raise ModelLoadError(f"cannot load the model in {model_dir}: {e}") from e


def use_default_chat_template(tokenizer, model_dir: Path) -> None:
    """As mlx-lm's --use-default-chat-template: a tokenizer without a chat template takes
    its default_chat_template; one without either cannot serve chats, which is said now."""
    if tokenizer.chat_template is not None:  # its own, or --chat-template's: that one wins
        return
    default = getattr(tokenizer, "default_chat_template", None)
    if default is None:
        raise ModelLoadError(f"the tokenizer in {model_dir} has no chat template and no default_chat_template "
                             "for --use-default-chat-template (transformers no longer gives tokenizers one): give "
                             "a template with serve's --chat-template, or leave the option out")
    tokenizer.chat_template = default
    tokenizer.has_chat_template = True  # mlx-lm's wrapper reads it (it was set before the template was)
    log.info("chat template: the tokenizer's default_chat_template (--use-default-chat-template)")


def warn_if_beyond_wired(model: nn.Module, wired: Optional[int]) -> None:
    """mlx-lm's warning: weights near the recommended working set leave the caches little
    room, and decoding slows down as memory is swapped."""
    if not wired:
        return
    weights = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    if weights > 0.9 * wired:
        log.warning("the model's weights take %d MiB, close to the device's recommended working set of "
                    "%d MiB: decoding may be slow (see mlx-lm's notes on large models)",
                    weights >> 20, wired >> 20)
