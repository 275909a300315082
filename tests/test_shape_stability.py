"""The decode cycle is shape-stable: after warm-up, a prompt length never seen before
brings no new array shape into the draft / verify / accept / rollback path (a GPU
backend that plans or compiles kernels per shape then compiles nothing new), and the
verify reaches mlx-lm's own Gated DeltaNet dispatch."""

import random

import mlx.core as mx
import pytest
from engine_helpers import loaded, oracle_hook, prompt_of, reference_greedy
from mlx_lm.models import gated_delta

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.compiled_head import CompiledHead
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.policy.base import Policy
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling import rejection as rejection_sampler
from mlxmtp.mlxlm import gdn_capture


def _shape(x):
    return tuple(x.shape) if isinstance(x, mx.array) else type(x).__name__


class ShapeRecorder:
    """Records the shapes of every attention and Gated DeltaNet call, and of the cycle's
    own arrays, while the engine is inside a drafting cycle (not during prefill, and not
    in plain decoding, which keeps mlx-lm's own one-token attention call)."""

    def __init__(self, monkeypatch, eng):
        self.shapes, self.active = set(), False
        sdpa, gdn = mx.fast.scaled_dot_product_attention, gated_delta.gated_delta_update

        def spy_sdpa(q, k, v, *args, mask=None, **kw):
            if self.active:
                self.shapes.add(("sdpa", _shape(q), _shape(k), _shape(v), _shape(mask)))
            return sdpa(q, k, v, *args, mask=mask, **kw)

        def spy_gdn(*args, **kw):
            if self.active:
                self.shapes.add(("gdn",) + tuple(_shape(a) for a in args))
            return gdn(*args, **kw)

        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy_sdpa)
        monkeypatch.setattr(gated_delta, "gated_delta_update", spy_gdn)
        launch, finish = eng._launch, eng._finish

        def watched_launch(k, *a, **kw):
            self.active = k > 0
            try:
                rec = launch(k, *a, **kw)
            finally:
                self.active = False
            if k > 0:
                self.shapes.add(("cycle", k, _shape(rec.kept), _shape(rec.tokens), _shape(rec.hidden)))
            return rec

        def watched_finish(rec, *a, **kw):
            self.active = rec.k > 0
            try:
                return finish(rec, *a, **kw)
            finally:
                self.active = False

        monkeypatch.setattr(eng, "_launch", watched_launch)
        monkeypatch.setattr(eng, "_finish", watched_finish)


def run(eng, prompt, n, ref=None, depth=None):
    req = Request(prompt=prompt, max_tokens=n, num_draft=depth)
    if ref is not None:
        eng.draft_hook = oracle_hook({req.id: reference_greedy(ref, prompt, n)}, p_correct=0.6, seed=len(prompt))
    eng.submit(req)
    out = []
    while eng.has_work:
        for ev in eng.step():
            out += ev.token_ids
    return out


# Warm-up: one request per cache-capacity bucket (256 tokens) and depth. Shapes depend
# on the bucket and the cycle's depth by design (a request's last cycles draft fewer
# tokens: only what is left), never on the position inside the bucket.
WARM_UP = [5, 300, 560]
NEW_LENGTHS = [7, 33, 100, 201, 249, 260, 333, 450, 511, 590]


MODES = {"synchronous": {}, "pipelined": {"pipeline_drafts": True}, "compiled": {"compile_steps": True},
         "pipelined, compiled": {"pipeline_drafts": True, "compile_steps": True}}


@pytest.mark.slow
@pytest.mark.parametrize("family,mode", [(f, m) for f in ("qwen3_5", "qwen3_next") for m in list(MODES)[:3]]
                         + [("qwen3_6_moe", "compiled"), ("qwen3_5", "pipelined, compiled")])
@pytest.mark.parametrize("k", [1, 4])
def test_shape_stable_cycles_stay_exact_in_a_batch(fixture_model, family, k, mode):
    """The GPU default, run here: greedy output equals mlx-lm's for rows joining at
    different times, whatever each row keeps; drafting cycles synchronous, pipelined, or
    with the head's steps and the accept step compiled."""
    model, tok, ref = loaded(str(fixture_model(family)["hf"]))
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=k, shape_stable=True, prefill_step=64, **MODES[mode]))
    reqs = [Request(prompt=prompt_of(n, seed=n), max_tokens=30) for n in (4, 90, 270)]
    want = {r.id: reference_greedy(ref, r.prompt, 30) for r in reqs}
    eng.draft_hook = oracle_hook(want, p_correct=0.6, seed=k)
    got = {r.id: [] for r in reqs}
    for step, r in enumerate(reqs):
        eng.submit(r)
        for _ in range(step * 3):
            for ev in eng.step():
                got[ev.request_id] += ev.token_ids
    while eng.has_work:
        for ev in eng.step():
            got[ev.request_id] += ev.token_ids
    assert got == want


@pytest.mark.slow
@pytest.mark.parametrize("k,pipelined", [(4, False), (3, True)])
def test_no_new_shapes_after_warm_up(fixture_model, monkeypatch, k, pipelined):
    """Warm-up at every depth up to k, then new prompt lengths, each pinned to one of those
    depths in turn (a request's `num_draft`)."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    # shape_stable: the default on GPU backends
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=k, shape_stable=True, pipeline_drafts=pipelined))
    rec = ShapeRecorder(monkeypatch, eng)
    for n in WARM_UP:
        for depth in range(1, k + 1):
            run(eng, prompt_of(n, seed=n), 48, ref, depth)
    seen = set(rec.shapes)
    assert any(s[0] == "sdpa" and s[1][2] == k + 1 for s in seen)  # the verify was recorded
    for i, n in enumerate(NEW_LENGTHS):
        run(eng, prompt_of(n, seed=n), 8, ref, depth=1 + i % k)
        assert rec.shapes == seen, (n, rec.shapes - seen)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
def test_compiled_steps_trace_nothing_new_after_warm_up(fixture_model, monkeypatch, k):
    """With `compile_steps`, MLX traces (and compiles) the head's steps and the accept step
    once per shape: after warm-up, new prompt lengths add no trace. The traced functions'
    Python bodies run only while MLX traces them, so they count the traces."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    traces = []
    pure_step = CompiledHead._pure_step

    def counted_step(self, embeddings, hidden, ends, kv):
        traces.append(("head", embeddings.shape, kv[0].shape))
        return pure_step(self, embeddings, hidden, ends, kv)

    def counted_accept(logits, drafts):
        traces.append(("accept", logits.shape))
        return rejection_sampler.accept_greedy(logits, drafts)

    monkeypatch.setattr(CompiledHead, "_pure_step", counted_step)
    monkeypatch.setattr(model, "compiled_head", None)  # a new one, tracing through the counter
    monkeypatch.setattr(rejection_sampler, "compiled_accept_greedy", mx.compile(counted_accept))
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=k, shape_stable=True, compile_steps=True))
    for n in WARM_UP:
        for depth in range(1, k + 1):
            run(eng, prompt_of(n, seed=n), 48, ref, depth)
    warm = list(traces)
    assert {t[0] for t in warm} == {"head", "accept"}
    for n in NEW_LENGTHS:
        assert run(eng, prompt_of(n, seed=n), 8, ref) == reference_greedy(ref, prompt_of(n, seed=n), 8)
        assert traces == warm, (n, traces[len(warm):])


def test_verify_calls_mlx_lm_gated_delta_dispatch(fixture_model, monkeypatch):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    calls = []
    dispatch = gated_delta.gated_delta_update

    def spy(q, *args, **kw):
        calls.append(q.shape[1])
        return dispatch(q, *args, **kw)

    monkeypatch.setattr(gated_delta, "gated_delta_update", spy)
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=3, shape_stable=True))
    prompt = prompt_of(20, seed=1)
    assert run(eng, prompt, 30, ref) == reference_greedy(ref, prompt, 30)
    assert 4 in calls  # the verify's k+1 positions went through mlx-lm's dispatch
    # The capture's own steps are the dispatch's ops path, hooked where the dispatch looks it
    # up: wherever the dispatch takes a fused kernel instead, it stays on the path
    # (tests/test_gdn_capture.py runs that way with a stand-in kernel).
    assert gated_delta.gated_delta_ops is gdn_capture._recording_ops


class ScriptedPolicy(Policy):
    """A depth policy that plays a fixed script of depths (0 = plain decoding), cyclically:
    stretches of plain decoding of chosen lengths between drafting cycles."""

    max_depth = 4
    why = "scripted"

    def __init__(self, script, plain):
        self.script, self.i, self.plain = script, 0, plain

    def choose(self, batch_size, limit=None, classes=None, requests=None):
        k = self.script[self.i % len(self.script)]
        self.i += 1
        return min(k, limit) if limit is not None else k

    def update(self, *args, **kwargs):
        pass

    def plain_regime(self):
        return self.plain


def switching_script(stretches, k=2):
    out = []
    for s in stretches:
        out += [0] * s + [k] * 2
    return out


@pytest.mark.slow
@pytest.mark.parametrize("plain", [True, False])
def test_no_new_shapes_after_warm_up_when_switching(fixture_model, monkeypatch, plain):
    """Switches between plain decoding and drafting: the head's catch-up over the inputs of
    a plain stretch of any length takes one of a few padded shapes (query_bucket)."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    eng = BatchGenerator(model, tok, EngineConfig(shape_stable=True))
    rec = ShapeRecorder(monkeypatch, eng)
    for n in (5, 260):  # every stretch length bucket, in each capacity bucket used below
        eng.policy = ScriptedPolicy(switching_script([1, 2, 3, 5, 9, 17, 33, 70]), plain)
        run(eng, prompt_of(n, seed=n), 190, ref)
    seen = set(rec.shapes)
    rng = random.Random(3)
    for n in (11, 77, 270, 301):
        eng.policy = ScriptedPolicy(switching_script(rng.sample(range(1, 71), 5)), plain)
        run(eng, prompt_of(n, seed=n), 150, ref)
        assert rec.shapes == seen, (n, rec.shapes - seen)


def test_head_step_over_a_whole_buffer_is_masked(fixture_model):
    """A one-token head step on a shape-stable cache sees only the written slots: its
    output equals the step on a sliced cache (it used to attend to the whole buffer)."""
    import numpy as np

    from mlxmtp.mlxlm import adapter

    model, _, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    head, H = model.head, model.parts.args.hidden_size
    outs = []
    for fixed in (False, True):
        mx.random.seed(0)
        cache = adapter.make_head_cache(head, 1)
        if fixed:
            cache.fix_shapes(1)
        head(mx.random.normal((1, 20, H)), mx.random.normal((1, 20, H)), cache)
        outs.append(head(mx.random.normal((1, 1, H)), mx.random.normal((1, 1, H)), cache))
    assert cache[0].keys.shape[2] > 21  # the step got the whole buffer
    np.testing.assert_allclose(np.array(outs[1]), np.array(outs[0]), rtol=1e-4, atol=1e-5)
