"""Patch: record Gated DeltaNet state after every position of a forward.

Verification feeds k+1 tokens; when only m+1 of them are accepted, the layer's
state must be the one after position m. Re-running the model would cost a second
forward, so while `record()` is active each Gated DeltaNet layer reports
- its conv input (`conv_state ++ new inputs`), from which the conv state after any
  position is a slice, and
- its recurrent state after each position.

mlx-lm's off-Metal path already computes these (a loop of one-step updates) and
keeps only the last; we run the same loop with the same step function, so the
outputs are bit-identical, and keep references to every step (free: arrays are
immutable, a reference is never a copy). On Metal mlx-lm's fused kernel writes
only the final state, so while recording we take the same per-step path there too.
Outside `record()` nothing changes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta, qwen3_5, qwen3_next


@dataclass
class LayerRecord:
    conv_input: Optional[mx.array] = None  # [B, kernel-1+T, conv_dim]
    states: List[mx.array] = field(default_factory=list)  # T x [B, Hv, Dv, Dk]


class Recorder:
    def __init__(self):
        self.layers: List[LayerRecord] = []
        self._conv_pending: Optional[mx.array] = None


_ACTIVE: Optional[Recorder] = None
_original_update = gated_delta.gated_delta_update


@contextlib.contextmanager
def record():
    """Record every Gated DeltaNet layer's per-position state, in layer order."""
    global _ACTIVE
    prev, _ACTIVE = _ACTIVE, Recorder()
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = prev


def _recording_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *,
                      use_kernel=True, lower_bound=None, allow_neg_eigval=False):
    rec = _ACTIVE
    if rec is None:
        return _original_update(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
                                lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)
    # Same preamble and step as mlx_lm.models.gated_delta.gated_delta_update / gated_delta_ops.
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    if lower_bound is None:
        g = gated_delta.compute_g(A_log, a, dt_bias)
    else:
        g = gated_delta.compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if (repeat := Hv // Hk) > 1:
        q = mx.repeat(q, repeat, -2)
        k = mx.repeat(k, repeat, -2)
    ys, states = [], []
    for t in range(T):
        y, state = gated_delta._gated_delta_step_ops(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None if mask is None else mask[:, t]
        )
        ys.append(y)
        states.append(state)
    rec.layers.append(LayerRecord(conv_input=rec._conv_pending, states=states))
    rec._conv_pending = None
    return mx.stack(ys, axis=1), state


class RecordingConv1d(nn.Conv1d):
    """The Gated DeltaNet depthwise conv; its input is the full conv window."""

    def __call__(self, x):
        if _ACTIVE is not None:
            _ACTIVE._conv_pending = x
        return super().__call__(x)


_installed = False


def install(model: nn.Module) -> None:
    """Route the Gated DeltaNet layers of `model` through the recording hooks (idempotent)."""
    global _installed
    if not _installed:
        # Both model files import the function by name; patch where it is looked up.
        qwen3_5.gated_delta_update = _recording_update
        qwen3_next.gated_delta_update = _recording_update
        _installed = True
    for _, m in model.named_modules():
        if isinstance(m, (qwen3_5.GatedDeltaNet, qwen3_next.Qwen3NextGatedDeltaNet)):
            if type(m.conv1d) is nn.Conv1d:
                m.conv1d.__class__ = RecordingConv1d
