"""Start-up calibration of cycle costs (engine/policy/calibration.py): the adaptive policy knows
every depth's cost before its first cycle, skips its calibration blocks, and the cycles
it times itself still take over. Batch sizes reached later are never calibrated (that
would hold up every active row): they learn their costs from their own cycles."""

import pytest
from engine_helpers import calibration_calls, loaded, prompt_of, reference_greedy

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.generate import generate
from mlxmtp.engine.pieces import model_pieces
from mlxmtp.engine.policy import adaptive, calibration
from mlxmtp.engine.policy.adaptive import DepthPolicy
from mlxmtp.engine.policy.cycle_costs import CycleCosts
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.models.load import load


@pytest.mark.slow
@pytest.mark.parametrize("batch_size,pipelined", [(1, False), (3, True)])
def test_measured_costs_cover_every_depth(fixture_model, batch_size, pipelined):
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    BatchGenerator(model, tok)  # prepares the model (Gated DeltaNet capture)
    runs = []
    costs = calibration.measure_cycle_costs(model_pieces(model, True), batch_size, 4, shape_stable=True,
                                            pipelined=pipelined, progress=lambda: runs.append(1))
    assert sorted(costs) == ["greedy", "sampled"]
    assert len(runs) == 2 * 5 * (calibration.REPS + 1)  # each kind's run of each depth, every round
    for seconds in costs.values():
        assert sorted(seconds) == [0, 1, 2, 3, 4]
        assert all(c > 0 for c in seconds.values())


def test_adaptive_engine_calibrates_once_and_stays_exact(fixture_model, monkeypatch):
    """An engine whose first cycle finds no costs (`mlxmtp generate`) measures its batch's
    kind only; a batch of the other kind later learns its costs from its own cycles."""
    path = str(fixture_model("qwen3_next")["hf"])
    _, _, ref = loaded(path)
    model, tok = load(path)  # a model of its own: the policy is shared by the model's engines
    kinds = []
    calls = calibration_calls(monkeypatch, kinds)
    prompt = prompt_of(30, seed=4)
    reasons = []
    for _ in range(2):
        eng = BatchGenerator(model, tok)
        res = generate(model, tok, prompt, max_tokens=40, engine=eng)
        assert res.token_ids == reference_greedy(ref, prompt, 40)
        reasons.append(res.stats.depth_reasons)
    assert calls == [1] and kinds == [("greedy",)]
    # The calibration is a prior: plain decoding and k = 1 are still measured live, in the
    # first request's first cycles, and not again.
    assert adaptive.CALIBRATING in reasons[0] and adaptive.CALIBRATING not in reasons[1]
    assert all(c is not None for c in eng.policy.costs[1, "greedy"].costs(range(5)).values())
    assert not eng.policy.costs.get((1, "sampled"), CycleCosts()).priors
    sampled = generate(model, tok, prompt, max_tokens=40, engine=BatchGenerator(model, tok),
                       params=SamplingParams(temperature=0.8, seed=1))
    assert calls == [1]  # never held up by a second calibration
    assert adaptive.CALIBRATING in sampled.stats.depth_reasons
    assert eng.policy.costs[1, "sampled"].samples(0) > 0


def test_an_engine_asked_to_calibrate_measures_both_kinds(fixture_model, monkeypatch):
    """What the server does at start-up (and the benchmarks that stand for it): greedy and
    sampled batches both priced before any request."""
    model, tok = load(str(fixture_model("qwen3_5")["hf"]))
    kinds = []
    calls = calibration_calls(monkeypatch, kinds)
    eng = BatchGenerator(model, tok)
    assert eng.calibrate(1) and calls == [1] and kinds == [("greedy", "sampled")]
    for kind in ("greedy", "sampled"):
        assert all(c is not None for c in eng.policy.costs[1, kind].costs(range(5)).values())
    assert not eng.calibrate(1) and calls == [1]


def test_pinned_depths_do_not_calibrate(fixture_model, monkeypatch):
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    monkeypatch.setattr(calibration, "measure_cycle_costs", lambda *a, **kw: pytest.fail("calibrated"))
    generate(model, tok, prompt_of(10), max_tokens=10, config=EngineConfig(num_draft=2))


def test_timed_cycles_replace_the_seed():
    table = CycleCosts(window=15)
    table.seed({0: 1.0, 1: 1.2, 2: 1.4})
    assert table.costs([0, 1, 2]) == pytest.approx({0: 1.0, 1: 1.2, 2: 1.4})
    table.add(0, 1.0, 0)  # one live pair of plain and k = 1 cycles: k = 1 really costs 2x
    table.add(1, 2.0, 1)
    # The measured ratio replaces the prior, and moves k = 2, priced relative to k = 1.
    assert table.costs([0, 1, 2]) == pytest.approx({0: 1.0, 1: 2.0, 2: 2.0 * 1.4 / 1.2})


def test_seeded_costs_are_checked_live_before_they_decide():
    # A calibration on a busy machine priced k = 1 at 2.2x plain decoding (it costs 1.1x):
    # on the seeds alone plain decoding would win and stay. Live blocks of plain decoding
    # and k = 1 replace that prior within the first cycles; drafting pays from then on.
    policy, cost, prev = DepthPolicy(max_depth=3), {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}, None
    assert policy.needs_costs(1)
    policy.seed_costs(1, {0: 1.0, 1: 2.2, 2: 2.4, 3: 2.6})
    assert not policy.needs_costs(1) and not policy.needs_costs(2)
    chosen = []
    for _ in range(40):  # drafts always kept
        k = policy.choose(1, 100, ["greedy"])
        timed = prev is not None and (prev == 0) == (k == 0)
        policy.update(k, 1, cost[k] if timed else None, [k], ["greedy"])
        chosen.append(k)
        prev = k
    assert chosen[:3] == [0, 0, 0] and 0 not in chosen[20:] and policy.regime > 0
    c = policy.costs[1, "greedy"].costs([0, 1])
    assert c[1] / c[0] == pytest.approx(1.1)


def test_new_batch_sizes_learn_their_costs_without_a_calibration(fixture_model, monkeypatch):
    """After the calibration for one row, rows joining a running batch are never held up
    by another calibration: the new batch bucket's costs come from its own cycles
    (calibration blocks of plain decoding and k = 1), and output stays exact."""
    path = str(fixture_model("qwen3_5")["hf"])
    _, _, ref = loaded(path)
    model, tok = load(path)  # a model of its own: the policy is shared by the model's engines
    calls = calibration_calls(monkeypatch)
    eng = BatchGenerator(model, tok, EngineConfig(max_batch=4))
    assert eng.calibrate(1) and calls == [1]
    prompts = [prompt_of(12 + 5 * i, seed=i) for i in range(4)]
    ids = [eng.submit(Request(prompt=p, max_tokens=30)) for p in prompts]
    out, reasons = {i: [] for i in ids}, set()
    while eng.has_work:
        for ev in eng.step():
            out[ev.request_id] += ev.token_ids
        if len(eng.rows) == 4:
            reasons.add(eng.why)
    assert calls == [1]
    assert adaptive.CALIBRATING in reasons  # bucket 4 measured live, while decoding
    policy = eng.policy
    assert all(policy.costs[4, "greedy"].samples(k) >= policy.cfg.min_samples for k in (0, 1))
    for i, p in zip(ids, prompts):
        assert out[i] == reference_greedy(ref, p, 30)
