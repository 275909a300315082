"""Patch: keep what a verify needs to roll each Gated DeltaNet layer back to any position.

Verification feeds k+1 tokens; when only m+1 of them are accepted, the layer's state
must be the one after position m. Re-running the model would cost a second forward, so
while `record()` is active each Gated DeltaNet layer keeps
- its conv input (`conv_state ++ new inputs`), from which the conv state after any
  position is a slice, and
- the recurrent state from before the verify and the recurrence's per-position inputs
  (q, k, v, a, b as the layer passed them), from which `LayerRecord.state_after` rebuilds
  the state after the accepted positions with the recurrence alone (not the layer's
  projections), or picks it from the states the verify computed on the way (below).

`Recorder` is the explicit object: a forward run inside `with recorder.active():` (or
`with record() as rec:`) fills `rec.layers`. The verify itself goes through mlx-lm's own
`gated_delta_update` dispatch, so it takes mlx-lm's fused kernel wherever mlx-lm has one
(Metal) and its ops path elsewhere (CUDA, the CPU). The two roll back differently:
- after the fused kernel (one launch for all T positions, no intermediate states) the
  replay goes through the same dispatch with a mask that stops each row at its accepted
  length (a masked step keeps the state as it was);
- where the dispatch takes its ops path, that path already computes the state after every
  position, one step at a time: the record keeps them (`LayerRecord.states`), and a
  rollback selects one per row instead of replaying up to T steps of several kernels each
  (as long as they fit `STATE_BUDGET_BYTES`; the layers past it replay).
Either way each row gets exactly the state a plain decoder would have. Outside `record()`
nothing changes.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta

from .family import layer_classes, patched_modules


@dataclass
class LayerRecord:
    conv_input: Optional[mx.array] = None  # [B, kernel-1+T, conv_dim]
    inputs: tuple = ()  # (q, k, v, a, b, A_log, dt_bias) as passed to gated_delta_update
    state_before: Optional[mx.array] = None  # [B, Hv, Dv, Dk]
    mask: Optional[mx.array] = None  # the verify's own [B, T] mask, if it had one
    options: dict = field(default_factory=dict)  # use_kernel, lower_bound, allow_neg_eigval
    final_state: Optional[mx.array] = None  # the verify's state after all T positions
    # The state after each of the T positions (mlx-lm's ops path computed them), or None:
    # the dispatch took a fused kernel, and a rollback replays.
    states: Optional[List[mx.array]] = None

    def state_after(self, kept: Union[Sequence[int], mx.array]) -> mx.array:
        """The recurrent state after kept[b] of the T verified positions of row b (host
        ints, or a [B] array not read yet: then the selection or replay is always built)."""
        T = self.inputs[0].shape[1]
        on_host = not isinstance(kept, mx.array)
        if on_host and all(n == T for n in kept):
            return self.final_state
        if self.states is not None:
            return self._select(kept, on_host)
        return self._replay(mx.array(kept) if on_host else kept)

    def _replay(self, kept: mx.array) -> mx.array:
        """Row b's state after kept[b] positions, by the recurrence over them alone."""
        T = self.inputs[0].shape[1]
        keep = mx.arange(T)[None, :] < kept[:, None]  # [B, T]; shape fixed by T
        if self.mask is not None:
            keep = keep & self.mask
        _, state = gated_delta.gated_delta_update(*self.inputs, self.state_before, keep, **self.options)
        return state

    def _select(self, kept, on_host: bool) -> mx.array:
        """Row b's state after kept[b] positions, from the recorded ones."""
        choices = [self.state_before, *self.states]  # choices[n]: after n positions
        if on_host:  # a slice per row: no kernel for one row, one copy for a batch
            if len(kept) == 1:
                return choices[kept[0]]
            return mx.concatenate([choices[n][b : b + 1] for b, n in enumerate(kept)])
        return _select_rows(kept, *choices)

    def select(self, rows: mx.array) -> "LayerRecord":
        """The record of the batch rows `rows` (row-less inputs, A_log and dt_bias, stay)."""
        q, k, v, a, b, A_log, dt_bias = self.inputs
        pick = [x[rows] for x in (q, k, v, a, b)]
        states = None if self.states is None else [s[rows] for s in self.states]
        return LayerRecord(self.conv_input[rows], (*pick, A_log, dt_bias), self.state_before[rows],
                           None if self.mask is None else self.mask[rows], self.options, self.final_state[rows],
                           states)


@mx.compile
def _select_rows(kept: mx.array, *choices: mx.array) -> mx.array:
    """Row b of choices[kept[b]], for counts still on the device: one fused elementwise
    kernel that writes B states (stacking the choices to gather from would copy all T+1)."""
    out = choices[0]
    for n in range(1, len(choices)):
        out = mx.where((kept == n)[:, None, None, None], choices[n], out)
    return out


# The most bytes of per-position states one verify keeps (T states per layer and row, held
# until the cycle is read; two cycles' worth when pipelined). Layers past it roll back by
# replay: a large batch of a large model cannot grow its transient memory by gigabytes.
STATE_BUDGET_BYTES = 512 * 2**20


class Recorder:
    """What one verify forward recorded: one LayerRecord per Gated DeltaNet layer, in
    layer order. Active inside `with recorder.active():` on the calling thread only."""

    def __init__(self):
        self.layers: List[LayerRecord] = []
        self._conv_pending: Optional[mx.array] = None
        self._states_pending: Optional[List[mx.array]] = None
        self.state_room = STATE_BUDGET_BYTES  # bytes of per-position states it may still keep

    def keep_states(self, nbytes: int) -> bool:
        """Whether a layer's per-position states of `nbytes` still fit the budget (taken if so)."""
        if nbytes > self.state_room:
            return False
        self.state_room -= nbytes
        return True

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
                                      state_before=state, mask=mask, options=options, final_state=final,
                                      states=rec._states_pending))
        rec._conv_pending = rec._states_pending = None
    return y, final


_mlx_lm_ops = gated_delta.gated_delta_ops


def _recording_ops(q, k, v, g, beta, state=None, mask=None):
    """mlx-lm's `gated_delta_ops` (the dispatch's path where it has no fused kernel), keeping
    the state after every position for the active recorder. mlx-lm's loop returns the final
    state only, so it is restated here: the same steps (its own `_gated_delta_step_ops`) on
    the same inputs, hence the same y and states to the bit (tests/test_gdn_capture.py)."""
    rec = _CURRENT.get()
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    itemsize = (mx.float32 if state is None else state.dtype).size
    if rec is None or not rec.keep_states(T * B * Hv * Dv * Dk * itemsize):
        return _mlx_lm_ops(q, k, v, g, beta, state, mask)
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if (repeat := Hv // Hk) > 1:
        q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
    ys, states = [], []
    for t in range(T):
        y, state = gated_delta._gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state,
                                                     None if mask is None else mask[:, t])
        ys.append(y)
        states.append(state)
    rec._states_pending = states
    return mx.stack(ys, axis=1), state


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
    # Both model files import the function by name: patched where it is looked up. The
    # dispatch looks its ops path up in its own module when it takes it.
    for module in patched_modules("linear_attention"):
        if module.gated_delta_update is not _recording_update:
            module.gated_delta_update = _recording_update
    gated_delta.gated_delta_ops = _recording_ops
    for _, m in model.named_modules():
        if isinstance(m, layer_classes("linear_attention")):
            if type(m.conv1d) is nn.Conv1d:
                m.conv1d.__class__ = RecordingConv1d
