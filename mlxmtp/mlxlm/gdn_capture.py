"""Patch: keep what a verify needs to roll each Gated DeltaNet layer back to any position.

Verification feeds k+1 tokens; when only m+1 of them are accepted, the layer's state
must be the one after position m. Re-running the model would cost a second forward, so
while `record()` is active each Gated DeltaNet layer keeps
- its conv input (`conv_state ++ new inputs`), from which the conv state after any
  position is a slice, and
- the recurrent state from before the verify and the recurrence's per-position inputs
  (q, k, v, a, b as the layer passed them), from which `LayerRecord.state_after` replays
  the recurrence alone (not the layer's projections) over the accepted positions.

`Recorder` is the explicit object: a forward run inside `with recorder.active():` (or
`with record() as rec:`) fills `rec.layers`. The verify itself goes through mlx-lm's own `gated_delta_update` dispatch, so it takes
mlx-lm's fused kernel wherever mlx-lm has one (Metal) and its ops path elsewhere; the
replay goes through the same dispatch with a mask that stops each row at its accepted
length (a masked step keeps the state as it was), so it computes exactly the states
a plain decoder would have. Outside `record()` nothing changes.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta, qwen3_5, qwen3_next


@dataclass
class LayerRecord:
    conv_input: Optional[mx.array] = None  # [B, kernel-1+T, conv_dim]
    inputs: tuple = ()  # (q, k, v, a, b, A_log, dt_bias) as passed to gated_delta_update
    state_before: Optional[mx.array] = None  # [B, Hv, Dv, Dk]
    mask: Optional[mx.array] = None  # the verify's own [B, T] mask, if it had one
    options: dict = field(default_factory=dict)  # use_kernel, lower_bound, allow_neg_eigval
    final_state: Optional[mx.array] = None  # the verify's state after all T positions

    def state_after(self, kept: Union[Sequence[int], mx.array]) -> mx.array:
        """The recurrent state after kept[b] of the T verified positions of row b (host
        ints, or a [B] array not read yet: then the replay is always built)."""
        T = self.inputs[0].shape[1]
        on_host = not isinstance(kept, mx.array)
        if on_host and all(n == T for n in kept):
            return self.final_state
        kept = mx.array(kept) if on_host else kept
        keep = mx.arange(T)[None, :] < kept[:, None]  # [B, T]; shape fixed by T
        if self.mask is not None:
            keep = keep & self.mask
        _, state = gated_delta.gated_delta_update(*self.inputs, self.state_before, keep, **self.options)
        return state

    def select(self, rows: mx.array) -> "LayerRecord":
        """The record of the batch rows `rows` (row-less inputs, A_log and dt_bias, stay)."""
        q, k, v, a, b, A_log, dt_bias = self.inputs
        pick = [x[rows] for x in (q, k, v, a, b)]
        return LayerRecord(self.conv_input[rows], (*pick, A_log, dt_bias), self.state_before[rows],
                           None if self.mask is None else self.mask[rows], self.options, self.final_state[rows])


class Recorder:
    """What one verify forward recorded: one LayerRecord per Gated DeltaNet layer, in
    layer order. Active inside `with recorder.active():` on the calling thread only."""

    def __init__(self):
        self.layers: List[LayerRecord] = []
        self._conv_pending: Optional[mx.array] = None

    @contextlib.contextmanager
    def active(self):
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)


# The recorder of the forward running on this thread, if any. mlx-lm's layers call the
# module-level `gated_delta_update` and their conv by name, with nothing that could carry
# a recorder along, so the hooks find it here (a context variable: scoped to the `with`
# block and to the thread or task that entered it).
_CURRENT: contextvars.ContextVar[Optional[Recorder]] = contextvars.ContextVar("gdn_recorder", default=None)


def record():
    """A new Recorder, active for the `with` block: `with record() as rec: forward(...)`."""
    return Recorder().active()


def _recording_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *,
                      use_kernel=True, lower_bound=None, allow_neg_eigval=False):
    options = dict(use_kernel=use_kernel, lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)
    rec = _CURRENT.get()
    if rec is not None and state is None:  # the dispatch starts from zeros; so must a replay
        B, _, _, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    # Looked up at call time: mlx-lm's dispatch (tests may watch it).
    y, final = gated_delta.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask, **options)
    if rec is not None:
        rec.layers.append(LayerRecord(conv_input=rec._conv_pending, inputs=(q, k, v, a, b, A_log, dt_bias),
                                      state_before=state, mask=mask, options=options, final_state=final))
        rec._conv_pending = None
    return y, final


class RecordingConv1d(nn.Conv1d):
    """The Gated DeltaNet depthwise conv; its input is the full conv window."""

    def __call__(self, x):
        rec = _CURRENT.get()
        if rec is not None:
            rec._conv_pending = x
        return super().__call__(x)


def install(model: nn.Module) -> None:
    """Route the Gated DeltaNet layers of `model` through the recording hooks, once per
    model (idempotent); outside an active recorder they change nothing."""
    # Both model files import the function by name: patched where it is looked up.
    for module in (qwen3_5, qwen3_next):
        if module.gated_delta_update is not _recording_update:
            module.gated_delta_update = _recording_update
    for _, m in model.named_modules():
        if isinstance(m, (qwen3_5.GatedDeltaNet, qwen3_next.Qwen3NextGatedDeltaNet)):
            if type(m.conv1d) is nn.Conv1d:
                m.conv1d.__class__ = RecordingConv1d
