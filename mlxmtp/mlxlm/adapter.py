"""The engine's forward pass, caches and rollback over mlx-lm's model classes."""

from __future__ import annotations

from typing import List, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from . import gdn_capture, row_attention
from .family import TextParts, check_patched
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


def make_cache(parts: TextParts, batch_size: int = 1) -> list:
    """Ragged KV caches for attention layers, mlx-lm ArraysCache for Gated DeltaNet layers
    (for the layers this process runs: all, or its share of a pipeline split)."""
    return [ArraysCache(size=2) if is_linear(layer) else RaggedKVCache(batch_size)
            for layer in local_layers(parts.backbone)]


def make_head_cache(head, batch_size: int = 1) -> list:
    return [RaggedKVCache(batch_size) for _ in head.layers]


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


def gdn_layers(cache: list) -> List[ArraysCache]:
    return [c for c in cache if isinstance(c, ArraysCache)]


def attention_caches(cache: list) -> List[RaggedKVCache]:
    return [c for c in cache if isinstance(c, RaggedKVCache)]


def fix_shapes(cache: list, from_tokens: int) -> None:
    """Forwards of `from_tokens` or more tokens see whole, masked attention buffers
    (RaggedKVCache's shape-stable mode): their shapes never depend on positions."""
    for c in attention_caches(cache):
        c.fixed_shape_from = from_tokens


def commit(cache: list, records: list, kept: Sequence[int], verified: int) -> None:
    """Roll every layer back to the state after `kept[b]` of the `verified` tokens of row b.

    Attention: trim each row's end. Gated DeltaNet: the conv state is a slice of the
    recorded conv window; the recurrent state is the one the verify recorded at the kept
    position, or replayed from the state before the verify over the kept positions
    (gdn_capture.LayerRecord.state_after), so no second forward of the model is needed.
    """
    trims = [verified - n for n in kept]
    if not any(trims):
        return  # the forward already left every layer at its final state
    for c in attention_caches(cache):
        c.trim_rows(trims)
    gdn = gdn_layers(cache)
    assert len(gdn) == len(records), "recorded Gated DeltaNet layers do not match the cache"
    if len(kept) == 1:  # one row: the conv state is a plain slice
        for c, rec in zip(gdn, records):
            n = kept[0]
            c[0] = rec.conv_input[:, n : n + rec.conv_input.shape[1] - verified]
            c[1] = rec.state_after(kept)
        return
    _roll_back_gdn(gdn, records, mx.array(kept), kept, verified)


def _roll_back_gdn(gdn: list, records: list, consumed: mx.array, kept, verified: int) -> None:
    """Each Gated DeltaNet layer to its state after consumed[b] ([B] array) of the verified
    tokens of row b: the conv window's slice, and the recurrent state at the kept positions,
    recorded or replayed (`kept`: the same counts as host ints, or the array itself)."""
    for c, rec in zip(gdn, records):
        n_keep = rec.conv_input.shape[1] - verified
        pos = (consumed[:, None] + mx.arange(n_keep))[..., None]
        c[0] = mx.take_along_axis(rec.conv_input, pos, axis=1)
        c[1] = rec.state_after(kept)


def commit_unread(cache: list, records: list, consumed: mx.array, verified: int) -> None:
    """`commit` for a cycle not read yet: consumed [B] int32 on the device. Attention caches
    defer their trims (settled by `settle` once read); Gated DeltaNet states are rebuilt from
    the array, selected or replayed (shape-stable caches only)."""
    for c in attention_caches(cache):
        c.defer_trim(verified - consumed)
    _roll_back_gdn(gdn_layers(cache), records, consumed, consumed, verified)


def settle(cache: list, trims: Sequence[int]) -> None:
    """The oldest deferred trim of every attention cache, now known on the host."""
    for c in attention_caches(cache):
        c.settle_trim(list(trims))


def filter_cache(cache: list, rows: List[int]) -> None:
    for c in cache:
        c.filter(rows)


def extend_cache(cache: list, other: list) -> None:
    for c, o in zip(cache, other):
        c.extend(o)


def extract_cache(cache: list, row: int) -> list:
    out = []
    for c in cache:
        if isinstance(c, RaggedKVCache):
            out.append(c.extract(row))
        else:
            e = ArraysCache(len(c.cache))
            e.cache = [None if a is None else a[row : row + 1] for a in c.cache]
            out.append(e)
    return out


def copy_cache(cache: list) -> list:
    """A shallow copy: arrays are immutable, so sharing them is safe and free."""
    out = []
    for c in cache:
        if isinstance(c, RaggedKVCache):
            out.append(c.copy())
        else:
            e = ArraysCache(len(c.cache))
            e.cache = list(c.cache)
            out.append(e)
    return out


def owned_copy(cache: list) -> list:
    """A copy whose arrays hold only their own data (evaluate them to drop the sources).

    An MLX slice is a view: it keeps its whole source buffer alive. One row of a batch
    cache (`extract_cache`) would keep every row's KV at the buffer's full capacity, and
    every row's Gated DeltaNet state. `mx.contiguous` copies a view that covers part of
    its buffer and shares an array that is its whole buffer."""
    out = copy_cache(cache)
    for c in out:
        if isinstance(c, RaggedKVCache):
            if c.keys is not None:
                c.keys, c.values = mx.contiguous(c.keys), mx.contiguous(c.values)
        else:
            c.cache = [None if a is None else mx.contiguous(a) for a in c.cache]
    return out


def cache_arrays(cache: list) -> List[mx.array]:
    """Every array a cache holds (what to evaluate so its state is materialised)."""
    out = []
    for c in cache:
        if isinstance(c, ArraysCache):  # Gated DeltaNet
            out += [a for a in c.cache if a is not None]
        elif c.keys is not None:  # attention KV
            out += [c.keys, c.values]
    return out


def cache_nbytes(cache: list) -> int:
    return sum(c.nbytes for c in cache)
