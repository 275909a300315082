"""Gated DeltaNet rollback, both ways: where mlx-lm's dispatch takes its ops path (CUDA, the
CPU) the verify keeps the state after every position and a rollback selects one; where it
takes a fused kernel (Metal) the record has no such states and a rollback replays through
the dispatch. A stand-in kernel (mlx-lm's own ops, called past the recording hook, so it
exposes no intermediate states, like the kernel) runs the second way here."""

import contextlib

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import loaded, oracle_hook, prompt_of, reference_greedy
from mlx_lm.models import gated_delta
from test_engine_rollback import assert_caches_equal, reference_cache

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.request import Request
from mlxmtp.mlxlm import gdn_capture
from mlxmtp.testing import fixtures as fx


def _inputs(B, T, Hk, Hv, D, vector_gate, seed):
    key = iter(mx.random.split(mx.random.key(seed), 8))
    q, k = (mx.random.normal((B, T, Hk, D), key=next(key)) * 0.3 for _ in range(2))
    v = mx.random.normal((B, T, Hv, D), key=next(key))
    g_shape = (B, T, Hv, D) if vector_gate else (B, T, Hv)
    g = mx.sigmoid(mx.random.normal(g_shape, key=next(key)) + 2)
    beta = mx.sigmoid(mx.random.normal((B, T, Hv), key=next(key)))
    state = mx.random.normal((B, Hv, D, D), key=next(key))
    return q, k, v, g, beta, state


@pytest.mark.parametrize("vector_gate", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_recorded_ops_path_is_mlx_lms_to_the_bit(vector_gate, masked):
    q, k, v, g, beta, state = _inputs(3, 5, 2, 4, 16, vector_gate, seed=1)
    mask = mx.array([[True] * 5, [True, True, True, False, False], [True, False, True, True, False]])
    mask = mask if masked else None
    want_y, want_state = gdn_capture._mlx_lm_ops(q, k, v, g, beta, state, mask)
    with gdn_capture.record() as rec:
        y, final = gdn_capture._recording_ops(q, k, v, g, beta, state, mask)
    assert np.array_equal(np.array(y), np.array(want_y))
    assert np.array_equal(np.array(final), np.array(want_state))
    assert len(rec._states_pending) == 5
    for t, recorded in enumerate(rec._states_pending):  # the state after t + 1 positions
        _, after = gdn_capture._mlx_lm_ops(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g[:, : t + 1],
                                           beta[:, : t + 1], state, None if mask is None else mask[:, : t + 1])
        assert np.array_equal(np.array(recorded), np.array(after))


@contextlib.contextmanager
def stand_in_kernel(monkeypatch):
    """mlx-lm's dispatch as if it took a fused kernel: the same numbers, no per-position
    states. Yields the list of (positions, recording?) of every call."""
    dispatch, calls = gated_delta.gated_delta_update, []

    def kernel_dispatch(q, *args, **kw):
        calls.append((q.shape[1], gdn_capture._CURRENT.get() is not None))
        with monkeypatch.context() as m:
            m.setattr(gated_delta, "gated_delta_ops", gdn_capture._mlx_lm_ops)
            return dispatch(q, *args, **kw)

    monkeypatch.setattr(gated_delta, "gated_delta_update", kernel_dispatch)
    yield calls


def _decode_checking_caches(eng, ref, prompts, n=40):
    """Decode the prompts with drafts right 60% of the time (every acceptance length), and
    check every row's caches against a plain decoder's every other cycle."""
    wants = {}
    for prompt in prompts:
        req = Request(prompt=prompt, max_tokens=n)
        wants[req.id] = reference_greedy(ref, prompt, n)
        eng.submit(req)
    eng.draft_hook = oracle_hook(wants, p_correct=0.6, seed=1)
    got, checked = {i: [] for i in wants}, 0
    while eng.has_work:
        events = eng.step()
        if eng.rows and eng.cycles % 2 == 0:
            events += eng.flush()
            for i, row in enumerate(eng.rows):
                assert_caches_equal(eng.cache, reference_cache(ref, row.tokens[:-1]), row=i)
                checked += 1
        for ev in events:
            got[ev.request_id] += ev.token_ids
    assert got == wants and checked >= 10


def _spy_verify_records(monkeypatch, verifies=None):
    """Every record the verifies make (and, in `verifies`, each verify's list of them)."""
    seen = []
    verify = gdn_capture.Recorder.active

    @contextlib.contextmanager
    def active(self):
        with verify(self) as rec:
            yield rec
        seen.extend(rec.layers)
        if verifies is not None:
            verifies.append(rec.layers)

    monkeypatch.setattr(gdn_capture.Recorder, "active", active)
    return seen


def _spy_rollbacks(monkeypatch):
    """Count the two ways LayerRecord.state_after rolls a layer back."""
    ways = {"select": 0, "replay": 0}
    for way in ways:
        original = getattr(gdn_capture.LayerRecord, "_" + way)

        def counted(self, *args, _way=way, _original=original):
            ways[_way] += 1
            return _original(self, *args)

        monkeypatch.setattr(gdn_capture.LayerRecord, "_" + way, counted)
    return ways


@pytest.mark.slow
@pytest.mark.parametrize("pipelined", [False, True])
def test_ops_path_rolls_back_by_selecting_recorded_states(fixture_model, monkeypatch, pipelined):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    seen, ways = _spy_verify_records(monkeypatch), _spy_rollbacks(monkeypatch)
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=3, shape_stable=True, pipeline_drafts=pipelined))
    _decode_checking_caches(eng, ref, [prompt_of(9 + 5 * b, seed=b) for b in range(3)])
    assert seen and all(r.states is not None and len(r.states) == r.inputs[0].shape[1] for r in seen)
    assert ways["select"] > 0 and ways["replay"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("pipelined", [False, True])
def test_fused_kernel_path_rolls_back_by_replay(fixture_model, monkeypatch, pipelined):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    seen, ways = _spy_verify_records(monkeypatch), _spy_rollbacks(monkeypatch)
    with stand_in_kernel(monkeypatch) as calls:
        eng = BatchGenerator(model, tok, EngineConfig(num_draft=3, shape_stable=True, pipeline_drafts=pipelined))
        _decode_checking_caches(eng, ref, [prompt_of(9 + 5 * b, seed=b) for b in range(3)])
    assert seen and all(r.states is None for r in seen)
    assert ways["replay"] > 0 and ways["select"] == 0
    assert (4, True) in calls  # the verify's 4 positions went to the "kernel" in one call
    assert (4, False) in calls  # and so did the replays of partly accepted cycles


def test_states_past_the_budget_roll_back_by_replay(fixture_model, monkeypatch):
    """A verify keeps per-position states while they fit its budget; the layers past it
    replay, and every row still ends in a plain decoder's state."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    verifies = []
    _spy_verify_records(monkeypatch, verifies)
    ways = _spy_rollbacks(monkeypatch)
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=3, shape_stable=True))
    # The budget of one Gated DeltaNet layer's states for 3 rows at 4 positions.
    B, T = 3, 4
    sizes = fx.DEFAULT_SIZES
    Hv, Dv, Dk = (sizes[n] for n in ("linear_num_value_heads", "linear_value_head_dim", "linear_key_head_dim"))
    monkeypatch.setattr(gdn_capture, "STATE_BUDGET_BYTES", B * T * Hv * Dv * Dk * 4)
    _decode_checking_caches(eng, ref, [prompt_of(9 + 5 * b, seed=b) for b in range(B)])
    full = [layers for layers in verifies if layers and layers[0].inputs[0].shape[:2] == (B, T)]
    assert full and all([r.states is not None for r in layers] == [True, False, False] for layers in full)
    assert ways["select"] > 0 and ways["replay"] > 0
