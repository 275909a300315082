"""The engine's forward pass and new caches over mlx-lm's model classes."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from . import gdn_capture, row_attention
from .family import TextParts, check_patched
from .model_cache import ModelCache
from .pipeline import local_layers
from .ragged_cache import RaggedKVCache


def prepare_model(model: nn.Module) -> None:
    """One-time patches: rollback's records (gdn_capture) and attention per group of rows
    in batches of very different lengths (row_attention); both change no output. A layer
    they did not reach is refused now (family.check_patched)."""
    gdn_capture.install(model)
    row_attention.install()
    check_patched(local_layers(model.model))


def is_linear(layer) -> bool:
    return bool(getattr(layer, "is_linear", False))


def make_cache(parts: TextParts, batch_size: int = 1) -> ModelCache:
    """Ragged KV caches for attention layers, mlx-lm ArraysCache for Gated DeltaNet layers
    (for the layers this process runs: all, or its share of a pipeline split)."""
    return ModelCache(ArraysCache(size=2) if is_linear(layer) else RaggedKVCache(batch_size)
                      for layer in local_layers(parts.backbone))


def make_head_cache(head, batch_size: int = 1) -> ModelCache:
    return ModelCache(RaggedKVCache(batch_size) for _ in head.layers)


def forward(parts: TextParts, tokens: mx.array, cache: list, hidden_state: str = "post_norm"):
    """One backbone forward -> (logits, hidden for the MTP head).

    The logits are computed by the same calls as mlx-lm's own `__call__` (backbone, then
    lm_head / tied embedding), so they are identical; the post-norm hidden state is the
    backbone's output itself, free. Pre-norm is the input of the final norm, which a tap
    installed on that norm once keeps (see _norm_tap).
    """
    if hidden_state == "pre_norm":
        tap = _norm_tap(parts.backbone.norm)
        h = parts.backbone(tokens, cache)
        x, tap.x = tap.x, None
        return parts.lm_head(h), x
    h = parts.backbone(tokens, cache)
    return parts.lm_head(h), h


class _TapSlot:
    """Where a tapped norm leaves its last input (a plain object: an array attribute of an
    nn.Module would become one of its parameters)."""

    x = None


def _norm_tap(norm: nn.Module) -> _TapSlot:
    """The norm's tap, installed on first use: its class becomes a subclass that keeps its
    input in the tap (same computation, same parameters)."""
    tap = getattr(norm, "_mlxmtp_tap", None)
    if tap is None:
        base = type(norm)

        def __call__(self, x):
            self._mlxmtp_tap.x = x
            return base.__call__(self, x)

        tap = _TapSlot()
        norm._mlxmtp_tap = tap
        norm.__class__ = type(f"Tapped{base.__name__}", (base,), {"__call__": __call__})
    return tap
