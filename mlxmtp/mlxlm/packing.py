"""A verify whose rows carry different numbers of real tokens: the per-token work on those only.

A hybrid cycle (engine/proposers/hybrid.py) verifies every row at its longest row's length:
rows copying text carry a suffix draft of 8-32 tokens, and the rows beside them a few of the
head's drafts, padded to it. Where a forward costs what its tokens cost (a CPU; a GPU once a
batch's tokens outgrow what reading the weights hides, as a large model's long verify does)
the padding costs as much as real tokens. Inside `real_tokens(lengths)` each layer's MLP (or
mixture of experts), its attention's projections and the lm_head, most of a token's work, run
on the rows' first `lengths[b]` positions only, packed into one sequence; the padded positions
get zeros there. The attention and Gated DeltaNet operations still see every position: their
caches and the rollback's records keep the padded layout, and causality keeps the real
positions' results those of the padded forward (up to a matmul's rounding over fewer rows). A
padded position's logits are then meaningless, so the cycle keeps no draft past a row's real
ones (cycle.verify).

mlx-lm has no such path (its batches pad); vLLM and SGLang pack every forward's tokens
(ragged batches), which mlx-lm's caches do not take. Packing per-token layers is what this
needs of that, with mlx-lm's modules and kernels unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from .pipeline import local_layers

# Pack only where padding is at least this share of a forward's tokens: below it, the two
# gathers a layer costs more than the padded rows' work they save where a forward is bound by
# reading the weights.
MIN_PADDING = 0.25
# The share of a padded token's work that packing saves: all but the attention and Gated
# DeltaNet layers' own (their convolution, recurrence and records, the attention itself).
# About 0.65 on the demo model (bench/split_verify.py, BENCHMARKS.md); a larger model's MLPs
# and projections are more of a token's work, so this errs low.
SAVED = 0.6


class _Packed:
    """The forward in progress's packing (a plain object, not a module attribute: an array
    attribute of an nn.Module would become one of its parameters)."""

    shape: Optional[tuple] = None  # (B, T) of the padded layout
    index: Optional[mx.array] = None  # [N] flat positions of the real tokens
    inverse: Optional[mx.array] = None  # [B*T] each position's packed index, or N (zeros)
    # (input, its packed rows) of the last call: an attention's projections share their input
    # (q, k and v; a Gated DeltaNet's input projections), which is then packed once.
    last: Optional[tuple] = None


_PACKED = _Packed()


def worth_packing(lengths: Sequence[int], T: int) -> bool:
    """Whether the padding of rows of `lengths` real tokens at length T is worth packing away."""
    return bool(lengths) and sum(lengths) <= (1.0 - MIN_PADDING) * len(lengths) * T


def equivalent_depth(lengths: Sequence[int], K: int) -> Optional[float]:
    """The depth of a verify without padding that costs what a packed verify of depth K with
    rows of `lengths` real tokens costs (each padded token costing 1 - SAVED of a real one;
    a verify costs about its tokens where packing matters); None where it is not packed."""
    if not worth_packing(lengths, K + 1):
        return None
    padding = len(lengths) * (K + 1) - sum(lengths)
    return max(1.0, K - SAVED * padding / len(lengths))


@contextmanager
def real_tokens(lengths: Sequence[int], T: int):
    """Forwards inside pack every layer's MLP and the lm_head to row b's first lengths[b] of
    T positions (`install` first)."""
    index, inverse = [], []
    for b, n in enumerate(lengths):
        inverse += [len(index) + t for t in range(n)]
        index += [b * T + t for t in range(n)]
        inverse += [-1] * (T - n)
    N = len(index)
    _PACKED.shape = (len(lengths), T)
    _PACKED.index = mx.array(index, dtype=mx.int32)
    _PACKED.inverse = mx.array([i if i >= 0 else N for i in inverse], dtype=mx.int32)
    try:
        yield
    finally:
        _PACKED.shape = _PACKED.index = _PACKED.inverse = _PACKED.last = None


def active() -> bool:
    return _PACKED.shape is not None


def packed_call(fn, x: mx.array) -> mx.array:
    """fn over the real positions of x ([B, T, D]) only -> [B, T, D']: zeros where padded."""
    B, T = _PACKED.shape
    if x.ndim != 3 or x.shape[:2] != (B, T):  # not this forward's tokens (a pipeline's other shapes)
        return fn(x)
    if _PACKED.last is None or _PACKED.last[0] is not x:
        _PACKED.last = (x, mx.take(x.reshape(B * T, -1), _PACKED.index, axis=0)[None])
    y = fn(_PACKED.last[1])[0]
    y = mx.concatenate([y, mx.zeros((1, y.shape[-1]), dtype=y.dtype)])
    return mx.take(y, _PACKED.inverse, axis=0).reshape(B, T, -1)


def install(model: nn.Module) -> None:
    """Make every local layer's MLP and its attention's projections pack inside `real_tokens`
    (idempotent; outside it they compute as they are): each one's class becomes a subclass
    with the same parameters."""
    for layer in local_layers(model.model):
        mlp = getattr(layer, "mlp", None)
        per_token = [mlp] if mlp is not None else []
        per_token += [m for name, m in layer.named_modules()
                      if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and not name.startswith("mlp")]
        for m in per_token:
            if not getattr(m, "_mlxmtp_packs", False):
                m.__class__ = _packing_class(type(m))


_CLASSES: dict = {}


def _packing_class(base: type) -> type:
    if base not in _CLASSES:
        def __call__(self, x):
            if _PACKED.shape is None:
                return base.__call__(self, x)
            return packed_call(lambda v: base.__call__(self, v), x)

        _CLASSES[base] = type(f"Packing{base.__name__}", (base,), {"__call__": __call__, "_mlxmtp_packs": True})
    return _CLASSES[base]
