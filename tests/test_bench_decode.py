"""bench/decode.py: the interleaved timing it reports, and one tiny end-to-end run; and a
tiny run of bench/verify_forward.py and of bench/split_verify.py."""

import importlib.util
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _bench_module(name):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def decode():
    return _bench_module("decode")


class _Clock:
    """Stands in for an engine: records the time it is told to leave out."""

    def __init__(self):
        self.skipped = 0.0

    def skip_time(self, seconds):
        self.skipped += seconds


def _sleeper(n, per_token, step=1):
    for _ in range(0, n, step):
        time.sleep(per_token * step)
        yield step
    yield None


def test_interleaved_times_each_side_on_its_own_turns(decode):
    clock = _Clock()
    # A side twice as fast per token, producing 3 tokens a step (a drafting engine), beside
    # a plain one: each side's rate is its own, whatever the other costs.
    fast, slow = decode.interleaved([(_sleeper(48, 0.002, 3), clock), (_sleeper(40, 0.004), None)], chunk=8)
    assert fast["first"] == 3 and slow["first"] == 1  # prefill / first step: not timed
    assert fast["tokens"] == 45 and slow["tokens"] == 39
    assert fast["done"] and slow["done"]
    assert 300 < fast["tps"] <= 500 and 150 < slow["tps"] <= 250
    assert fast["tps"] / slow["tps"] == pytest.approx(2.0, rel=0.3)
    # The engine is told about all the other side's time, first turn included.
    assert clock.skipped >= slow["seconds"] and clock.skipped == pytest.approx(slow["seconds"] + 0.004, abs=0.01)


@pytest.mark.slow
def test_benchmark_runs_end_to_end_on_the_demo_model(decode, capsys, monkeypatch):
    costs = decode.forward_costs  # one timed round of each forward is enough to check the table
    monkeypatch.setattr(decode, "forward_costs", lambda model, sizes, reps=20: costs(model, sizes, reps=1))
    path = str(decode.demo_model_path())
    decode.bench_model("demo", path, temps=[0.0], depths=[1], rounds=1, max_tokens=12, markdown=True,
                       compiled=True, shape_stable=True, pipelined=True)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ml")]
    assert [r.split(" | ")[0].split(" (")[0] for r in rows] == [
        "| mlx-lm generate", "| mlxmtp MTP off", "| mlxmtp k=1", "| mlxmtp adaptive", "| mlxmtp k=1, compiled",
        "| mlxmtp adaptive, compiled", "| mlxmtp k=1, pipelined", "| mlxmtp adaptive, pipelined"]
    assert "(depths used: " in rows[3] and "(depths used: " in rows[-1]
    k1 = rows[2].split(" | ")
    assert float(k1[2].rstrip("x")) > 0 and 0.0 <= float(k1[4]) <= 1.0  # speedup, acceptance


def test_verify_forward_bench_times_both_forwards(capsys):
    """Both sides decode the same context: the engine's verify forward (recording for
    rollback) and mlx-lm's own forward; the table has a ratio per T for both cache modes."""
    vf = _bench_module("verify_forward")
    from mlxmtp.models.demo import demo_model_path
    from mlxmtp.models.load import load

    model, _ = load(str(demo_model_path()))
    vf.report(model, context=40, reps=1)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| s")]
    assert [r.split(" | ")[0] for r in rows] == ["| sliced", "| shape-stable"]
    for r in rows:
        ratios = [float(x.rstrip("x ")) for x in r.strip("| ").split(" | ")[1:]]
        assert len(ratios) == 5 and all(0.2 < x < 5 for x in ratios), r


def test_split_verify_bench_times_both_ways_and_counts_the_real_tokens(capsys):
    """A padded verify of 3 rows against a forward per draft length (1 row of T tokens, 2 of
    2): a ratio per T, beside the share of the padded forward's tokens that are real."""
    sv = _bench_module("split_verify")
    from mlxmtp.models.demo import demo_model_path
    from mlxmtp.models.load import load

    model, _ = load(str(demo_model_path()))
    got = sv.report(model, rows=3, long_rows=1, short=2, sizes=[3, 5], context=16, reps=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "| long rows' T | 3 | 5 |"
    assert lines[-1] == "| real tokens / padded tokens | 0.778 | 0.600 |"  # (T + 2 * 2) / (3 * T)
    assert sorted(got) == [3, 5] and all(0.05 < r < 20 for r in got.values())


@pytest.mark.parametrize("unread", [False, True])
def test_gdn_rollback_bench_selects_with_fewer_ops_than_a_replay(monkeypatch, unread):
    """The bench's two ways give one layer's rollback; selecting a recorded state builds a
    handful of operations at most (none for one row with its count on the host)."""
    from mlx_lm.models import gated_delta

    from mlxmtp.mlxlm import gdn_capture

    bench = _bench_module("gdn_rollback")
    monkeypatch.setattr(gated_delta, "gated_delta_ops", gdn_capture._recording_ops)
    for B in (1, 3):
        layer = bench.verify_record(B, 4, 2, 4, 48)
        replay_nodes, _, select_nodes, _ = bench.row(layer, B, unread, reps=1)
        assert replay_nodes >= 4 * 5 and select_nodes <= 9
        if B == 1 and not unread:
            assert select_nodes == 0


def test_graph_ops_bench_counts_each_setting(fixture_model):
    """bench/graph_ops.py: MTP off evaluates what mlx-lm does per token; a drafting
    setting reports its drafts' and its verify's operations per cycle."""
    bench = _bench_module("graph_ops")
    from mlxmtp.models.load import load

    model, tok = load(str(fixture_model("qwen3_5")["hf"]))
    prompts = [[5, 9, 13, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
    theirs = bench.run_setting(model, tok, prompts, 10, 0.0, None)
    off = bench.run_setting(model, tok, prompts, 10, 0.0, {"enable_mtp": False})
    assert theirs["tokens"] == off["tokens"] == 20 and off["ops"] == theirs["ops"]
    k2 = bench.run_setting(model, tok, prompts, 10, 0.0, {"num_draft": 2})
    # Near max_tokens the last cycles draft fewer (or none); k = 2 is the depth in use.
    assert max(k2["depths"], key=k2["depths"].get) == 2 and set(k2["depths"]) <= {0, 1, 2}
    assert 0 < k2["draft"] < k2["verify"] < k2["ops"] and k2["tokens"] >= 20


def test_op_probe_times_every_operation():
    """scripts/gpu_op_probe.py builds and times each operation kind for T = 1 and 3."""
    sys.path.insert(0, str(BENCH.parent / "scripts"))
    try:
        import gpu_op_probe
    finally:
        sys.path.remove(str(BENCH.parent / "scripts"))
    import mlx.core as mx

    for name, make in gpu_op_probe.OPS.items():
        for T in (1, 3):
            assert gpu_op_probe.time_chain(make, T, mx.float16, chain=2, reps=1) > 0, name


def test_cycle_profile_splits_and_counts_each_forward(fixture_model):
    """bench/cycle_profile.py's forward split: build and evaluation times, and the
    operations evaluated, which grow with T (a Gated DeltaNet step per extra token)."""
    bench = _bench_module("cycle_profile")
    from mlxmtp.models.load import load

    model, _ = load(str(fixture_model("qwen3_5")["hf"]))
    split = bench.host_device_split(model, sizes=(1, 2), context=16, reps=1)
    assert all(build > 0 and run > 0 for build, run, _ in split.values())
    assert 0 < split[1][2] < split[2][2]


def test_row_leaves_bench_measures_the_short_row_alone_and_after(fixture_model):
    """bench/row_leaves.py: the short row's speed alone and once the long row has left,
    with the attention buffers then cut to the short row's capacity."""
    bench = _bench_module("row_leaves")
    from mlxmtp.models.load import load

    model, tok = load(str(fixture_model("qwen3_5")["hf"]))
    short, long = list(range(3, 23)), [(7 * i) % 280 + 3 for i in range(600)]
    for other in (None, long):
        speed, cap = bench.short_row_speed(model, tok, short, other, 2, 12)
        assert speed > 0 and cap == 256


def test_ragged_rows_bench_alternates_grouped_and_padded_attention(fixture_model, monkeypatch):
    """bench/ragged_rows.py: one engine, its windows alternating between grouped attention
    and one padded call (the call cost switched), then the default restored."""
    bench = _bench_module("ragged_rows")
    from mlxmtp.mlxlm import row_attention
    from mlxmtp.models.load import load

    model, tok = load(str(fixture_model("qwen3_5")["hf"]))
    monkeypatch.setattr(row_attention, "CALL_COST_POSITIONS", 16)
    rows = [[(7 * i) % 280 + 3 for i in range(300)], list(range(3, 23)), list(range(5, 15))]
    eng = bench.decoding_batch(model, tok, rows, 2, 80)
    assert len(eng.rows) == 3
    batch_sizes = []  # of each attention call while measuring
    inner = row_attention._mlx_lm_attention
    monkeypatch.setattr(row_attention, "_mlx_lm_attention",
                        lambda q, *a, **kw: batch_sizes.append(q.shape[0]) or inner(q, *a, **kw))
    grouped, padded = bench.measure(eng, 2, 2)
    assert len(grouped) == len(padded) == 2 and min(grouped + padded) > 0
    assert {1, 2, 3} <= set(batch_sizes)  # grouped (the long row; the two short) and padded calls
    assert row_attention.CALL_COST_POSITIONS == 16


def test_graph_ops_bench_counts_sampled_batches(fixture_model):
    """bench/graph_ops.py's sampled batches: four rows with top-p and top-k (filtered in
    one group) cost few operations more per cycle than four temperature-only rows, and
    fewer than four rows with a repetition penalty (decided row by row); four reproducible
    seeded rows cost fewer still over the temperature-only ones (their position keys; no
    rejection sampling built)."""
    bench = _bench_module("graph_ops")
    from mlxmtp.models.load import load

    model, tok = load(str(fixture_model("qwen3_5")["hf"]))
    prompts = [[5, 9, 13, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
    tempered, filtered, penalty, seeded = (bench.batch_ops_per_cycle(model, tok, prompts, 4, params, 3, steps=4)
                                           for _, params in bench.BATCH_PARAMS)
    assert 0 < tempered < filtered < penalty and filtered - tempered < 0.2 * tempered
    assert tempered < seeded < filtered


@pytest.mark.slow
def test_structured_output_bench_holds_every_side_to_the_same_tokens(fixture_model):
    """bench/structured_output.py: mlx-lm's held decoding and every mlxmtp side decode the
    same held tokens (the ratios compare equal work)."""
    import mlx_lm

    bench = _bench_module("structured_output")
    from mlxmtp.models.load import load
    from mlxmtp.server.structured_output import grammar_for, serve_tokenizer

    path = str(fixture_model("qwen3_5")["hf"])
    model, tok = load(path)
    ref, _ = mlx_lm.load(path)
    serve_tokenizer(tok, model.parts.args.vocab_size)
    grammar = grammar_for(bench.SCHEMA, "bench")
    prompt = list(range(3, 40))
    gen, _ = bench.mlx_lm_side(ref, tok, prompt, 40, grammar)
    want = sum(n for n in gen if n is not None)
    for _, k in bench.SETTINGS[:4]:
        gen, engine = bench.mlxmtp_side(model, tok, prompt, 40, grammar, k)
        assert sum(n for n in gen if n is not None) == want and engine is not None


def test_policy_ab_runs_its_variant_on_a_policy_of_its_own():
    """bench/policy_ab.py: `--set` fields parse to the field's type, an unknown one is named,
    and the policy it installs is the one the next adaptive engine of the model takes."""
    ab = _bench_module("policy_ab")
    cfg = ab.variant_config(["request_weight=16", "margin=0.1", "calibrate=false"])
    assert (cfg.request_weight, cfg.margin, cfg.calibrate) == (16.0, 0.1, False)
    with pytest.raises(SystemExit, match="no field 'nope'"):
        ab.variant_config(["nope=1"])
    from mlxmtp.engine.batch import BatchGenerator
    from mlxmtp.engine.config import EngineConfig
    from mlxmtp.engine.policy.adaptive import DepthPolicy
    from mlxmtp.models.demo import demo_model_path
    from mlxmtp.models.load import load

    model, tok = load(str(demo_model_path()))
    for policy in (DepthPolicy(config=cfg), DepthPolicy()):
        ab.use_policy(model, policy)
        assert BatchGenerator(model, tok, EngineConfig(enable_mtp=True)).policy is policy
    policy.accept.record(2, [1, 0], ["sampled", "sampled"])  # a steady k = 2 cycle of two sampled rows
    policy.accept.record(1, [1], ["greedy"])  # and a k = 1 cycle of a greedy one
    assert ab.first_drafts_by_depth(policy) == "greedy: k=1 1/1; sampled: k=2 1/2"


def test_policy_sim_prices_plain_decoding_at_one_token_a_cycle_and_drafting_above_it():
    """bench/policy_sim.py's stream is a close call drafting wins (BENCHMARKS.md): plain
    decoding makes exactly 1 token per plain cycle, the best fixed depth 1.1-1.3, and a policy
    on it lands between them."""
    sim = _bench_module("policy_sim")
    from mlxmtp.engine.policy.adaptive import DepthPolicy

    for scenario in sim.SCENARIOS:
        assert sim.run(0, fixed=0, **scenario)[0] == 1.0
        assert 1.1 < max(sim.run(0, fixed=k, **scenario)[0] for k in range(1, 5)) < 1.3
    worst, mean, plain = sim.scenario(DepthPolicy, 2, **sim.SCENARIOS[0])
    assert 0.7 < worst <= mean < 1.1 and 0 < plain < 1


def test_sampling_ops_bench_builds_and_times_every_kind_of_row():
    """bench/sampling_ops.py on a small vocabulary: each step of greedy, sampled and seeded
    rows builds a graph and is timed; the seeded accept step evaluates the keep chances."""
    ops = _bench_module("sampling_ops")
    for temp, seeded in ((0.0, False), (0.6, False), (0.6, True)):
        draft_step, accept_step = ops.steps(2, temp, seeded, 64)
        for step in (draft_step, accept_step):
            nodes, ms = ops.measure(step, reps=1)
            assert nodes > 0 and ms >= 0
        assert len(accept_step()) == (2 if temp == 0 else 3)  # kept, tokens (and the chances)
