"""The MTP head and the suffix drafter in one cycle (engine/proposers/hybrid.py): greedy
output stays mlx-lm's when long suffix drafts are kept, alone and in a batch whose other
rows draft with the head; sampled rows keep the target's distribution; the stats say which
drafter made what; and the plan picks the suffix only where it pays."""

import json
from types import SimpleNamespace

import pytest
from engine_helpers import asked_again, loaded, own_policies, prompt_of, reference_greedy
from test_sampling_exact import (  # noqa: F401  (pytest fixtures, used by name)
    PARAMS,
    N,
    OracleDraftEngine,
    _chi2_by_position,
    chi2_quantile,
    plain_samples,
    tiny_vocab_model,
)

from mlxmtp.engine import timing
from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.generate import generate
from mlxmtp.engine.policy.adaptive import DepthPolicy
from mlxmtp.engine.policy.base import GREEDY, OPENING_TOKENS
from mlxmtp.engine.proposers import fairness, hybrid_plan
from mlxmtp.engine.proposers.base import SUFFIX
from mlxmtp.engine.proposers.hybrid import HybridProposer
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.engine.state import acceptance_classes
from mlxmtp.engine.suffix_index import Draft
from mlxmtp.engine.token_index import MAX_MATCH
from mlxmtp.models.demo import demo_model_path


def _run(eng, reqs):
    got, stats = {r.id: [] for r in reqs}, {}
    for r in reqs:
        eng.submit(r)
    while eng.has_work:
        for ev in eng.step():
            got[ev.request_id] += ev.token_ids
            if ev.stats is not None:
                stats[ev.request_id] = ev.stats.as_dict()
    return [got[r.id] for r in reqs], [stats[r.id] for r in reqs]


@pytest.mark.parametrize("num_draft", [None, 3])
def test_the_demo_asked_again_is_drafted_by_the_suffix_and_stays_exact(num_draft):
    """The demo model, its prompt, its own answer and the prompt again: it mostly writes
    the answer again, which the suffix drafter finds in the prompt."""
    model, tok, ref = loaded(str(demo_model_path()))
    again = asked_again(tok, ref, 96)
    want = reference_greedy(ref, again, 96)
    with own_policies(model):  # a fresh process's policy: what other tests taught it would steer this one
        res = generate(model, tok, again, max_tokens=96, config=EngineConfig(num_draft=num_draft, suffix_drafts=True))
    assert res.token_ids == want
    s = res.stats.as_dict()
    assert s["by_source"]["suffix"]["accepted"] >= 48, s["by_source"]
    assert s["tokens_per_forward"] > 4 and max(s["depths"]) > 4, s
    assert s["depth_reasons"].get(SUFFIX, 0) > 0
    assert s["drafted"] == sum(v["drafted"] for v in s["by_source"].values())


def test_a_suffix_cycle_planned_while_a_plain_one_is_in_flight_drafts_from_the_suffix():
    """Plain cycles are pipelined: the next cycle is planned before the one in flight is read,
    and a plan with suffix rows reads it first. That read must not take the new plan for the
    old cycle's: the planned suffix draft would become a head chain of its length. With the
    head pinned to plain decoding every draft is the suffix's."""
    model, tok, ref = loaded(str(demo_model_path()))
    prompt = tok.encode('def parse_args(argv):\n    """Parse the command line."""\n')  # it repeats itself
    res = generate(model, tok, prompt, max_tokens=256, config=EngineConfig(num_draft=0, suffix_drafts=True))
    assert res.token_ids == reference_greedy(ref, prompt, 256)
    s = res.stats.as_dict()
    assert list(s["by_source"]) == ["suffix"] and s["by_source"]["suffix"]["accepted"] >= 128, s["by_source"]
    assert s["depths"][0] > 0 and s["depth_reasons"].get(SUFFIX, 0) == sum(n for k, n in s["depths"].items() if k)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_6_moe"])
@pytest.mark.parametrize("pipelined", [False, True])
def test_a_row_drafting_from_the_suffix_beside_rows_drafting_with_the_head(fixture_model, family, pipelined,
                                                                           monkeypatch):
    """A request asked a second time drafts its answer from the shared index of finished
    outputs, in the same cycles as two other rows' head drafts padded to its depth; float32
    fixtures: batched output equals mlx-lm's alone, bit for bit. Verifies priced as on a GPU
    (a few percent a token: long drafts pay in a batch)."""
    monkeypatch.setattr(hybrid_plan, "DEFAULT_SLOPE", 0.02)
    model, tok, ref = loaded(str(fixture_model(family)["hf"]))
    prompts = [prompt_of(11, seed=3), prompt_of(30, seed=4), prompt_of(5, seed=5)]
    want = [reference_greedy(ref, p, 40) for p in prompts]
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=2, suffix_drafts=True, pipeline_drafts=pipelined,
                                                  shape_stable=pipelined))
    assert isinstance(eng.proposer, HybridProposer)
    first, _ = _run(eng, [Request(prompt=prompts[0], max_tokens=40)])
    got, stats = _run(eng, [Request(prompt=p, max_tokens=40) for p in prompts])
    assert first == want[:1] and got == want
    again = stats[0]["by_source"]
    assert again["suffix"]["accepted"] >= 30, again  # most of the first answer
    assert max(stats[0]["depths"]) > 2 and max(stats[1]["depths"]) > 2  # head rows padded past k
    assert all(s["by_source"].get("mtp", {}).get("drafted", 0) > 0 for s in stats[1:])


@pytest.mark.slow
def test_sampled_rows_keep_the_target_distribution(tiny_vocab_model, plain_samples, monkeypatch):  # noqa: F811
    """Rows sampling the same prompt: each draws suffix drafts from the outputs before it
    (q a point mass) or head drafts (q the oracle's), mixed in one cycle; the tokens at
    positions 1 and 2 are distributed as plain sampling's. Verifies priced as on a GPU
    (a few percent a token), the head's drafts as poor and 2-token matches as enough, so that
    suffix drafts are many."""
    monkeypatch.setattr(hybrid_plan, "DEFAULT_SLOPE", 0.02)
    monkeypatch.setattr(hybrid_plan, "MIN_MATCH", 2)
    model, tok = tiny_vocab_model
    eng = OracleDraftEngine(model, tok, EngineConfig(num_draft=2, max_batch=64, prefix_cache_bytes=64 << 20,
                                                     suffix_drafts=True))
    eng.policy = _PoorHead(fixed=2)
    reqs = [Request(prompt=[5, 17, 42, 9, 33, 2], max_tokens=5, params=SamplingParams(**PARAMS, seed=5 * N + s))
            for s in range(N)]
    got, stats = _run(eng, reqs)
    by_source = [s["by_source"] for s in stats]
    assert sum(s.get("suffix", {}).get("drafted", 0) for s in by_source) > N
    assert sum(s.get("suffix", {}).get("accepted", 0) for s in by_source) > N // 10
    for stat, dof in _chi2_by_position(plain_samples, got):
        assert stat < chi2_quantile(dof), (stat, dof)


class _PoorHead(DepthPolicy):
    def expected_tokens(self, optimistic=False, classes=(None,)):
        return [1.0 + 0.05 * j for j in range(self.max_depth + 1)]


class _Policy:
    """Scripted estimates: each head draft kept with probability `a`; cycle costs 1 + slope*k."""

    def __init__(self, a=0.8, slope=0.1):
        self.a, self.slope = a, slope

    def expected_tokens(self, optimistic=False, classes=(None,)):
        return [sum(self.a ** i for i in range(j + 1)) for j in range(5)]

    def relative_costs(self, batch_size, classes, depths, cautious=False):
        return {k: 1 + self.slope * k for k in depths}


class _Row:
    def __init__(self, i, greedy=True):
        self.req = Request(prompt=[1], max_tokens=100)
        self.req.id = i
        self.sampler = type("S", (), {"params": SamplingParams(temperature=0 if greedy else 0.7),
                                      "reproducible": False})()
        self.generated = OPENING_TOKENS  # past its answer's opening: of its kind's class


def _draft(n, p):
    return Draft(list(range(n)), [p ** (i + 1) for i in range(n)], n)


def test_the_plan_takes_the_suffix_only_where_it_pays():
    rows, cal = [_Row(1), _Row(2)], hybrid_plan.Calibration()
    # A sure 16-token draft for each row: the cycle goes to 16, and the head does not run.
    plan = hybrid_plan.choose(3, rows, [_draft(16, 0.99)] * 2, _Policy(), cal, 32)
    assert plan.depth == 16 and plan.head_depth == 0 and plan.suffix_rows(rows) == [True, True]
    # One row alone with such a draft: 16 as well.
    assert hybrid_plan.choose(3, rows[:1], [_draft(16, 0.99)], _Policy(), cal, 32).depth == 16
    # A match of a few tokens (they recur anywhere) is no evidence, however sure its draft.
    plan = hybrid_plan.choose(3, rows, [Draft([7] * 16, [0.99] * 16, 3), Draft([], [], 0)], _Policy(), cal, 32)
    assert plan == hybrid_plan.head_only(3)
    # Where a verify costs about a token a draft (a CPU), a doubtful long draft does not pay.
    plan = hybrid_plan.choose(3, rows, [_draft(16, 0.7), _draft(16, 0.7)], _Policy(slope=1.0), cal, 32)
    assert plan.depth == 3 and not plan.suffix
    # Every row on the suffix: the head does not run; on shape-stable caches, a bucket.
    plan = hybrid_plan.choose(3, rows, [_draft(11, 0.99), _draft(11, 0.99)], _Policy(), cal, 32, shape_stable=True)
    assert plan.depth in hybrid_plan.SHAPE_BUCKETS and plan.head_depth == 0
    # A draft rejected at its first token is evidence about that token alone; drafts that
    # keep failing bring the class's factor down, and it recovers as cycles pass.
    fresh = (GREEDY, False)
    assert plan.calibration_keys[1] == fresh
    cal.update(rows[:1], plan, [1, 1])
    assert 0.6 < cal.factor(fresh) < 0.7
    for _ in range(5):
        cal.update(rows[:1], plan, [1, 1])
    assert cal.factor(fresh) < 0.3
    # ... but not a row whose last suffix draft was kept whole: it is calibrated apart.
    assert cal.factor((GREEDY, True)) == 1.0
    short_match = _draft(16, 0.99)._replace(match_len=4)
    streak = hybrid_plan.Reach()
    streak.whole[1] = True
    plan = hybrid_plan.choose(3, rows[:1], [short_match], _Policy(), cal, 32, reach=streak)
    assert plan.depth == 16 and plan.calibration_keys[1] == (GREEDY, True)
    assert hybrid_plan.choose(3, rows[:1], [short_match], _Policy(), cal, 32).depth < 16
    for _ in range(200):
        cal.fade()
    assert cal.factor(fresh) > 0.9


def test_a_row_that_copies_does_not_stall_the_rows_beside_it():
    """Two agents at once, one copying a file (a sure 16-token draft), one writing new code,
    the policy decoding plainly. A verify of 16 tokens costs 2.6 plain cycles here: by the
    batch's total it pays, while the other row would make one token per 2.6 cycles, less than
    0.8 of its own rate (`fairness.FAIR_SHARE`). So that row drafts with the head as deep as the
    head goes (its catch-up priced), where its drafts are kept; with a head that keeps next to
    nothing, the copy goes only as deep as leaves that row 0.8 of its rate (2 drafts: 1.2 plain
    cycles); and where each verified token costs a plain cycle (a CPU), the copy does not pay."""
    rows, cal, none = [_Row(1), _Row(2)], hybrid_plan.Calibration(), Draft([], [], 0)
    copying = _draft(16, 0.99)
    plan = hybrid_plan.choose(0, rows, [copying, none], _Policy(a=0.8), cal, 32)
    assert (plan.depth, plan.head_depth, plan.suffix_rows(rows)) == (16, 4, [True, False])
    plan = hybrid_plan.choose(0, rows, [copying, none], _Policy(a=0.05), cal, 32)
    assert (plan.depth, plan.head_depth, plan.suffix_rows(rows)) == (2, 0, [True, False])
    assert hybrid_plan.choose(0, rows, [copying, none], _Policy(slope=1.0), cal, 32) == hybrid_plan.head_only(0)


def _decoded(ledger, rows, cycles, tokens, cost):
    """`cycles` planned cycles of `rows`, each priced `cost` and yielding `tokens` a row."""
    for _ in range(cycles):
        ledger.charge(rows, cost)
        for row in rows:
            row.generated += tokens


def test_a_request_that_kept_plain_decodings_pace_can_afford_a_copying_rows_long_verify():
    """As above, with a head that keeps next to nothing: the row writing new code would make one
    token in a 16-token verify (2.6 plain cycles here), under 0.8 of its rate, so without its
    history the copy stops at 2. A request that has made a token per plain cycle for 100 cycles
    keeps 0.98 of plain decoding's rate after such a cycle (fairness.REQUEST_SHARE: 0.9), so the
    copy goes to 16; one already at 0.9 of it, or just arrived, cannot afford it."""
    rows, cal, none = [_Row(1), _Row(2)], hybrid_plan.Calibration(), Draft([], [], 0)
    copying, policy = _draft(16, 0.99), _Policy(a=0.05)
    ledger = fairness.Ledger()
    assert hybrid_plan.choose(0, rows, [copying, none], policy, cal, 32, ledger=ledger).depth == 2
    _decoded(ledger, rows, 100, 1, 1.0)
    plan = hybrid_plan.choose(0, rows, [copying, none], policy, cal, 32, ledger=ledger)
    assert (plan.depth, plan.head_depth, plan.suffix_rows(rows)) == (16, 0, [True, False])
    assert plan.cost == pytest.approx(2.6)
    _decoded(ledger, rows[1:], 100, 1, 1.25)  # now 200 tokens over 225 plain cycles: 0.89
    assert hybrid_plan.choose(0, rows, [copying, none], policy, cal, 32, ledger=ledger).depth == 2
    hybrid_plan.forget_absent(ledger.of, {1})
    assert set(ledger.of) == {1}


def test_rows_whose_drafts_go_untaken_are_looked_up_less_often():
    lookups = hybrid_plan.Lookups()

    def cycle(rid, taken):
        due = lookups.due(rid)
        if due:
            lookups.update([rid], {rid} if taken else set())
        return due

    assert all(cycle(1, False) for _ in range(4))  # four untaken: every other cycle from now
    assert [cycle(1, False) for _ in range(4)] == [False, True, False, True]
    for _ in range(80):
        cycle(1, False)
    assert [cycle(1, False) for _ in range(10)].count(True) == 2  # at most MAX_GAP cycles apart
    while not cycle(1, True):  # taken: looked up every cycle again
        pass
    assert all(cycle(1, False) for _ in range(4))
    lookups.forget_absent(set())
    assert not lookups.wait and not lookups.untaken


def test_generate_drafts_from_the_suffix_unless_told_not_to():
    from click.testing import CliRunner

    from mlxmtp.commands.main import main

    _, tok, ref = loaded(str(demo_model_path()))
    text = tok.decode(asked_again(tok, ref, 64))
    by_source = {}
    for flag in ("--suffix", "--no-suffix"):
        res = CliRunner().invoke(main, ["generate", "--prompt", text, "--no-chat-template", "--max-tokens", "48",
                                        "--json", flag])
        assert res.exit_code == 0, res.output
        by_source[flag] = json.loads(res.stdout.strip().splitlines()[-1])["stats"]["by_source"]
    assert by_source["--suffix"]["suffix"]["accepted"] > 24, by_source
    assert "suffix" not in by_source["--no-suffix"], by_source


def test_the_server_reports_drafts_by_source_in_usage_and_metrics():
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from server_helpers import ServerThread

    from mlxmtp.server.app import create_app

    model, tok, ref = loaded(str(demo_model_path()))
    with own_policies(model), ServerThread(create_app(model, tok)) as srv:
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": asked_again(tok, ref, 64), "max_tokens": 48, "temperature": 0}).json()
        usage = r["usage"]["mtp"]["by_source"]
        assert usage["suffix"]["accepted"] > 24, usage
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
    samples = {s.labels["source"]: s.value for s in fams["mlxmtp_drafted_tokens_by_source"].samples
               if s.name.endswith("_total")}
    assert samples["suffix"] == usage["suffix"]["drafted"]
    # The shared index holds the finished request's output (48 tokens), never its prompt.
    assert fams["mlxmtp_suffix_shared_tokens"].samples[0].value == 48
    assert 0 < fams["mlxmtp_suffix_shared_bytes"].samples[0].value < 2**20


def test_a_request_drafts_from_finished_outputs_unless_sharing_is_off():
    """The same request twice: the second drafts the first's answer from the shared index;
    with suffix_share off (`serve --no-suffix-share`) it has only its own prompt and output
    (the index holds nothing) and keeps fewer suffix drafts, and its text is the same either way."""
    model, tok, ref = loaded(str(demo_model_path()))
    prompt = tok.encode("import os\nimport sys\n\n\ndef main(argv):\n    ")
    kept = {}
    for share in (True, False):
        eng = BatchGenerator(model, tok, EngineConfig(suffix_drafts=True, suffix_share=share))
        first, _ = _run(eng, [Request(prompt=prompt, max_tokens=48)])
        second, (stats,) = _run(eng, [Request(prompt=prompt, max_tokens=48)])
        assert first == second == [reference_greedy(ref, prompt, 48)]
        kept[share] = stats["by_source"].get("suffix", {}).get("accepted", 0)
        index = eng.proposer.shared_index
        assert (index.tokens == 96) if share else (index is None), stats["by_source"]
    assert kept[True] > kept[False] and kept[True] >= 24, kept


def test_a_row_copying_a_long_run_drafts_long_beside_a_strong_head():
    """The head keeps nearly all its drafts on text being copied too; a row whose last 32
    tokens repeat earlier text still drafts long from the suffix (the rule of succession on
    its run), though its class's calibration has seen failures. The same draft resting on a
    4-token match does not beat the head."""
    rows, cal = [_Row(1)], hybrid_plan.Calibration()
    failed = hybrid_plan.CyclePlan(8, 0, {1: [0.9] * 8}, {1: (GREEDY, False)})
    for _ in range(3):
        cal.update(rows, failed, [1])
    assert cal.factor((GREEDY, False)) < 0.5
    strong = _Policy(a=0.96, slope=0.25)
    copying = Draft(list(range(32)), [1.0] * 32, 32)
    assert hybrid_plan.choose(3, rows, [copying], strong, cal, 32).depth >= 16
    assert hybrid_plan.choose(3, rows, [copying._replace(match_len=4)], strong, cal, 32) == hybrid_plan.head_only(3)


def test_suffix_depths_are_priced_with_the_policys_doubt_about_their_cost():
    """A long verify's cost measured a couple of times on a noisy machine may have come out low;
    the plan prices depths other than the head's with the policy's doubt about them, and a
    draft that pays only if the cost estimate is right waits until it is measured better."""
    rows = [GREEDY] * 4

    def policy_after(samples, jitter):
        """Plain cycles of 20 ms whose neighbours differ by `jitter`, and `samples` cycles of
        depth 8 at 6 plain cycles, each right after one."""
        policy = DepthPolicy()
        block = [(0, 0.02 * jitter), (0, 0.02 / jitter)] * 2 + [(0, 0.02), (8, 0.12)]
        for cycle, (k, seconds) in enumerate(block * samples):
            policy.cycles = cycle
            policy.update(k, 4, seconds, [0] * 4, rows, head=k == 0)
        return policy

    unsure, sure = policy_after(2, 1.2), policy_after(15, 1.01)
    assert unsure.relative_costs(4, rows, [8])[8] == pytest.approx(6.0)
    assert unsure.relative_costs(4, rows, [8], cautious=True)[8] > 7.5
    assert sure.relative_costs(4, rows, [8], cautious=True)[8] < 6.1
    # Four rows, each with an 8-token draft kept at 0.95 a token (7.4 tokens expected): a cycle
    # of about 6 plain ones pays if that is its cost (the head, at k = 0 here, makes 4 tokens a
    # plain cycle), and not if it may cost 30% more.
    four = [_Row(i) for i in range(4)]
    drafts = [_draft(8, 0.95)] * 4
    assert hybrid_plan.choose(0, four, drafts, sure, hybrid_plan.Calibration(), 8).depth == 8
    assert hybrid_plan.choose(0, four, drafts, unsure, hybrid_plan.Calibration(), 8) == hybrid_plan.head_only(0)


def test_a_suffix_depth_past_those_measured_is_tried_then_priced_as_measured():
    """A start-up calibration of depths 1-4 on a noisy machine can come out steep (here 0.47
    plain cycles a draft): its line would price a 32-token verify at 16 plain cycles, with
    the doubt at 20, and a sure 32-token copy could lose to the head's k = 2 and never be
    measured (a cold `mlxmtp generate` that copied at 2 tokens a cycle). A depth past the
    deepest measured one is priced halfway between that one's cost and the line's until it
    is measured; then as measured, cheap or dear."""
    plain, row = 0.017, [_Row(1)]
    copying = Draft(list(range(32)), [1.0] * 32, 32)

    def calibrated():
        policy = DepthPolicy()
        policy.seed_costs(1, {k: plain * (1 + 0.47 * k) for k in range(5)})
        return policy

    def after_a_verify_of_32(policy, cost):
        for cycle, (k, seconds) in enumerate([(2, plain * 1.94), (32, plain * cost)]):
            policy.cycles = cycle
            policy.update(k, 1, seconds, [0], [GREEDY], head=False)
        return policy

    assert calibrated().relative_costs(1, [GREEDY], [32])[32] > 15
    assert hybrid_plan.choose(2, row, [copying], calibrated(), hybrid_plan.Calibration(), 32).depth == 32
    cheap, dear = after_a_verify_of_32(calibrated(), 3.0), after_a_verify_of_32(calibrated(), 40.0)
    assert hybrid_plan.choose(2, row, [copying], cheap, hybrid_plan.Calibration(), 32).depth == 32
    assert hybrid_plan.choose(2, row, [copying], dear, hybrid_plan.Calibration(), 32).depth == 2


def _costs_measured(batch_size, costs, rounds=4):
    """A policy that timed `rounds` blocks of cycles of each depth in `costs` (in plain cycles)
    at this batch size, each right after the one before."""
    policy, rows = DepthPolicy(), [GREEDY] * batch_size
    for cycle, (k, c) in enumerate(list(costs.items()) * rounds):
        policy.cycles = cycle
        policy.update(k, batch_size, 0.02 * c, [0] * batch_size, rows, head=False)
    return policy


def test_a_long_verify_of_a_compute_bound_batch_is_not_tried_on_the_word_of_a_few_rows():
    """Eight rows where each verified token costs about a plain cycle (a compute-bound batch:
    depths 1 and 2 measured at 2 and 3 plain cycles): a 32-token verify costs ~20-30 plain
    cycles, so two rows copying cannot pay for it against plain decoding's 8 tokens a cycle,
    while all eight copying can. Priced as the deepest measured depth (3 plain cycles), each
    deeper depth was tried once, at a loss of ~20 cycles each."""
    policy, cal = _costs_measured(8, {0: 1.0, 1: 2.0, 2: 3.0}), hybrid_plan.Calibration()
    rows = [_Row(i) for i in range(8)]
    copying, none = Draft(list(range(32)), [1.0] * 32, 32), Draft([], [], 0)
    assert policy.relative_costs(8, [GREEDY], [32], cautious=True)[32] > 12
    assert hybrid_plan.choose(0, rows, [copying] * 2 + [none] * 6, policy, cal, 32) == hybrid_plan.head_only(0)
    plan = hybrid_plan.choose(0, rows, [copying] * 8, policy, cal, 32)
    assert plan.depth >= 16 and plan.suffix_rows(rows) == [True] * 8


def test_a_deeper_verify_is_never_priced_below_a_shallower_one():
    """Two noisy medians can say a verify of 16 tokens costs less than one of 8; the plan would
    then take the longer one on its word. Costs never fall with depth."""
    policy = _costs_measured(4, {0: 1.0, 8: 8.0, 16: 6.5})
    for cautious in (False, True):
        c = policy.relative_costs(4, [GREEDY], [8, 16, 32], cautious=cautious)
        assert c[8] <= c[16] <= c[32] and c[8] >= 7.9


def test_a_rows_reach_grows_with_drafts_kept_whole_and_shrinks_after_misses():
    reach, row = hybrid_plan.Reach(), _Row(1)
    plan = hybrid_plan.CyclePlan(8, 0, {1: [0.9] * 8}, {1: (GREEDY, False)})
    assert reach.get(1) == hybrid_plan.FIRST_REACH == 8
    reach.update([row], plan, [9])  # all 8 kept
    assert reach.get(1) == 16 and reach.whole == {1: True} and reach.run == {1: 9}
    reach.update([row], plan, [9])
    assert reach.run == {1: 18}
    reach.update([row], plan, [3])  # 2 kept: as it was; the run of copied text ends
    assert reach.get(1) == 32 and reach.whole == {1: False} and reach.run == {1: 0}
    for want in (16, 8, 4, 4):  # the first draft rejected
        reach.update([row], plan, [1])
        assert reach.get(1) == want
    reach.forget_absent(set())
    assert reach.get(1) == 8 and reach.whole == {} and reach.run == {}


def test_a_long_run_of_copied_text_is_evidence_past_the_indexs_longest_match():
    """The suffix index matches at most MAX_MATCH tokens back, so a row that has copied a file
    for 200 tokens shows the same 32-token match as one that has copied 32. Where a verify
    costs about a token a draft (a CPU, a compute-bound batch), the rule of succession on 32
    tokens leaves a 32-token draft short of paying, and on the run it pays; a match shorter than
    the index's bound says the text changed since, and the run no longer counts."""
    rows, cal = [_Row(1)], hybrid_plan.Calibration()
    failed = hybrid_plan.CyclePlan(8, 0, {1: [0.9] * 8}, {1: (GREEDY, False)})
    for _ in range(3):
        cal.update(rows, failed, [1])
    cpu = _Policy(slope=0.25)
    copying = Draft(list(range(MAX_MATCH)), [1.0] * MAX_MATCH, MAX_MATCH)
    reach = hybrid_plan.Reach()
    assert hybrid_plan.choose(3, rows, [copying], cpu, cal, 32, reach=reach).depth == 16
    reach.run[1] = 200
    assert reach.evidence(1, MAX_MATCH) == 200
    assert hybrid_plan.choose(3, rows, [copying], cpu, cal, 32, reach=reach).depth == 32
    shorter = copying._replace(match_len=MAX_MATCH - 1)
    assert reach.evidence(1, MAX_MATCH - 1) == MAX_MATCH - 1
    assert hybrid_plan.choose(3, rows, [shorter], cpu, cal, 32, reach=reach).depth == 16


def test_the_rows_on_the_head_in_a_suffix_cycle_teach_its_acceptance():
    """Several agents at once, some copying: most cycles carry a suffix draft, and the rows
    beside the copying ones draft with the head in them. Those rows teach the policy the
    head's acceptance at their depth (their drafts past it are padding, however many of
    them the verify kept); the suffix rows teach nothing of it."""
    policy, rows = DepthPolicy(), [_Row(i) for i in range(3)]
    classes = acceptance_classes(rows)
    rec = SimpleNamespace(rows=rows, drafted=[("suffix", 8), ("mtp", 3), ("mtp", 3)])
    timing._teach_head_rows(rec, policy, classes, [8, 5, 1], None)
    assert policy.accept.first_drafts_tried(GREEDY) == 2 and policy.accept.tried_at(GREEDY, 3) == 2
    after_one = policy.acceptance(GREEDY, 3)
    timing._teach_head_rows(SimpleNamespace(rows=rows, drafted=[("suffix", 8)] * 3), policy, classes, [8, 8, 8], None)
    assert policy.accept.tried_at(GREEDY, 3) == 2 and policy.acceptance(GREEDY, 3) == after_one
    # One row kept all 3 of its drafts, the other its first one: each position's share.
    prior = DepthPolicy().acceptance(GREEDY, 3)
    assert after_one[0] > prior[0] and after_one[1] < after_one[0]


def test_suffix_cycles_teach_the_depth_policy_their_cost_and_nothing_else():
    """A long verify of several rows can cost far more than a line through the head's depths
    says (a compute-bound batch): suffix cycles measure it, and teach no acceptance."""
    policy, rows = DepthPolicy(), [GREEDY] * 4
    for cycle, (k, seconds, head) in enumerate([(0, 0.02, True), (0, 0.02, True), (8, 0.12, False)] * 3):
        policy.cycles = cycle
        policy.update(k, 4, seconds, [8, 8, 0, 0], rows, head=head)
    assert policy.relative_costs(4, rows, [8])[8] == pytest.approx(6.0)
    assert policy.accept.first_drafts_tried(GREEDY) == 0
    # The engine times its suffix cycles (synchronous, from their launch) for the policy.
    model, tok, ref = loaded(str(demo_model_path()))
    again = asked_again(tok, ref, 64)
    eng = BatchGenerator(model, tok, EngineConfig(suffix_drafts=True))
    _run(eng, [Request(prompt=again, max_tokens=64)])
    measured = {k for table in eng.policy.costs.values() for k in table.log_costs()}
    assert max(measured) > eng.policy.max_depth, measured


def test_a_batch_size_with_no_slope_of_its_own_prices_a_head_step_by_the_one_row_tables():
    """The start-up calibration measures one row. A batch size reached later has no head
    cycles of its own measured at first, and a head step beside a copying row's suffix draft
    was priced at DEFAULT_SLOPE, 0.5 plain cycles, where a large model on an Apple GPU pays
    ~0.06: the rows writing new code drafted shallow beside the copying ones. The one-row
    table's slope prices it until the batch size has a slope of its own."""
    rows, cheap = [GREEDY] * 4, {k: 0.03 * (1 + 0.06 * k) for k in range(5)}
    policy = DepthPolicy()
    policy.seed_costs(1, cheap)
    assert hybrid_plan._costs(policy, 4, rows, [4, 16], 1, 4)[1] == pytest.approx(0.06, rel=0.05)
    assert hybrid_plan._costs(DepthPolicy(), 4, rows, [4, 16], 1, 4)[1] == hybrid_plan.DEFAULT_SLOPE
    measured = _costs_measured(4, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0})
    measured.seed_costs(1, cheap)
    assert hybrid_plan._costs(measured, 4, rows, [4, 16], 1, 4)[1] == pytest.approx(1.0, rel=0.05)
