"""Each draft's chance of being kept (sampling/accept.keep_chances), which the depth policy
learns acceptance from: for a sampled row min(1, p(x) / q(x)) of its draft x, whose mean is
the acceptance itself with less noise than the accept-or-reject outcome; for a reproducible
(seeded) row its chance under the shared noise (seeded.coupled_chances); for a greedy row
the outcome."""

import mlx.core as mx
import numpy as np
import pytest

from mlxmtp.engine.policy.acceptance import Acceptance
from mlxmtp.engine.policy.base import Policy
from mlxmtp.engine.sampling.accept import VerifyMetadata, accept
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.engine.sampling.row import RowSampler
from mlxmtp.engine.sampling.seeded import position_gumbels


def _accept(params, p_logits, drafts, q_logprobs):
    samplers = [RowSampler(SamplingParams(**st, seed=b)) for b, st in enumerate(params)]
    B = len(params)
    meta = VerifyMetadata(mx.array(drafts, dtype=mx.int32), q_logprobs, samplers, [[1]] * B, list(range(B)), None)
    kept, _, _, chances = accept(meta, p_logits)
    return np.array(kept), np.array(chances)


def test_a_sampled_rows_chance_averages_to_its_acceptance_with_less_spread_than_the_outcome():
    """1000 rows drafting from the same q against the same p (a head that mostly agrees):
    the chances' and the outcomes' means are sum(min(p, q)), the chances' spread a fraction
    of the outcomes'."""
    V, B = 6, 1000
    p = np.array([0.7, 0.2, 0.05, 0.03, 0.01, 0.01])
    q = np.array([0.8, 0.1, 0.04, 0.03, 0.02, 0.01])
    drafts = np.random.default_rng(0).choice(V, size=(B, 1), p=q)
    p_logits = mx.broadcast_to(mx.array(np.log(p), dtype=mx.float32), (B, 2, V))
    q_logprobs = mx.broadcast_to(mx.array(np.log(q), dtype=mx.float32), (B, 1, V))
    kept, chances = _accept([dict(temperature=1.0)] * B, p_logits, drafts, q_logprobs)
    acceptance = np.minimum(p, q).sum()  # 0.89
    np.testing.assert_allclose(chances[:, 0], np.minimum(1.0, p[drafts[:, 0]] / q[drafts[:, 0]]), rtol=1e-5)
    for outcome in (chances[:, 0], kept):
        assert abs(outcome.mean() - acceptance) < 3 * outcome.std() / np.sqrt(B)
    assert chances.std() < 0.5 * kept.std()


def test_a_reproducible_rows_chance_is_its_keep_probability_under_the_shared_noise():
    """2000 seeded rows, each drafting argmax(log q + G) with its own noise G at the position
    and kept while that is argmax(log p + G): for every draft value the rows' chance is the
    closed form, and the share of those rows kept matches it; the chances average to the
    outcomes with a fraction of their spread."""
    V, B = 6, 2000
    p = np.array([0.5, 0.25, 0.1, 0.1, 0.04, 0.01])
    q = np.array([0.7, 0.1, 0.1, 0.05, 0.03, 0.02])
    samplers = [RowSampler(SamplingParams(temperature=1.0, seed=b, reproducible=True)) for b in range(B)]
    log_q = mx.array(np.log(q), dtype=mx.float32)
    drafts = mx.argmax(log_q + position_gumbels(samplers, 1, V)[:, 0], axis=-1)[:, None]
    meta = VerifyMetadata(drafts.astype(mx.int32), mx.broadcast_to(log_q, (B, 1, V)), samplers, [[1]] * B,
                          list(range(B)), None)
    kept, _, _, chances = accept(meta, mx.broadcast_to(mx.array(np.log(p), dtype=mx.float32), (B, 2, V)))
    kept, chances, drafts = np.array(kept), np.array(chances)[:, 0], np.array(drafts)[:, 0]
    for x in range(V):
        rows = drafts == x
        closed_form = p[x] / (p[x] + np.maximum(p * q[x] - q * p[x], 0.0).sum())
        np.testing.assert_allclose(chances[rows], closed_form, rtol=1e-5)
        if rows.sum() >= 50:
            share = kept[rows].mean()
            assert abs(share - closed_form) < 3 * np.sqrt(closed_form * (1 - closed_form) / rows.sum()) + 1e-3
    assert abs(chances.mean() - kept.mean()) < 3 * kept.std() / np.sqrt(B)
    assert chances.std() < 0.6 * kept.std()


def test_a_greedy_rows_chances_are_its_outcomes_beside_a_sampled_row():
    V, k = 5, 3
    logits = mx.array(np.log(np.array([[0.6, 0.1, 0.1, 0.1, 0.1]] * (k + 1))), dtype=mx.float32)
    p_logits = mx.stack([logits, logits])
    drafts = [[0, 0, 2], [0, 1, 2]]  # the greedy row keeps two; its third is not the argmax
    q = np.full((2, k, V), 0.05)
    q[:, :, 0] = 0.8
    kept, chances = _accept([dict(temperature=0.0), dict(temperature=1.0)], p_logits, drafts,
                            mx.array(np.log(q), dtype=mx.float32))
    assert kept[0] == 2 and chances[0].tolist() == [1.0, 1.0, 0.0]
    np.testing.assert_allclose(chances[1], [0.6 / 0.8, 1.0, 1.0], rtol=1e-5)


def test_the_policy_counts_chances_as_kept_drafts():
    """Eight first drafts each rejected by the coin but each kept with chance 0.7: the
    request's and the class's estimates read 0.7 (shrunk to the prior), not 0."""
    by_chance, by_outcome = (Acceptance(2, prior_accept=0.5, prior_weight=2.0, depth_weight=4.0, decay=1.0)
                             for _ in range(2))
    for acc in (by_chance, by_outcome):
        acc.reopen("sampled", 8, request=1)
    for _ in range(8):
        by_chance.record(1, [0], ["sampled"], [1], chances=[[0.7]])
        by_outcome.record(1, [0], ["sampled"], [1])
    np.testing.assert_allclose(by_chance.requests.first_drafts(1), (8 * 0.7, 8.0))
    assert abs(by_chance.estimate("sampled", 1, request=1)[0] - (8 * 0.7 + 0.5 * 2) / 10) < 0.08
    assert by_outcome.estimate("sampled", 1, request=1)[0] < 0.15


class _Recording(Policy):
    """Stands in for the depth policy: depth 2 throughout, and keeps what each cycle reports."""

    def __init__(self):
        self.reports = []

    def choose(self, batch_size, limit=None, classes=None, requests=None):
        return min(2, limit if limit is not None else 2)

    def update(self, k, batch_size, seconds, kept_per_row, classes=None, switch_seconds=None, head=True,
               requests=None, chances=None):
        self.reports.append((k, kept_per_row, chances, requests))

    def plain_regime(self):
        return False


@pytest.mark.parametrize("reproducible", [False, True])
def test_the_engine_reports_each_drafts_chance_to_the_policy(fixture_model, reproducible):
    """A sampled (unseeded, or seeded and reproducible) and a greedy request decoded together:
    every drafting cycle reports a chance per row and draft; the greedy row's are its
    outcomes, the sampled row's are not all 0 or 1."""
    from engine_helpers import loaded, prompt_of

    from mlxmtp.engine.batch import BatchGenerator
    from mlxmtp.engine.request import Request

    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    eng = BatchGenerator(model, tok)
    eng.policy = _Recording()
    greedy = eng.submit(Request(prompt=prompt_of(12), max_tokens=24))
    eng.submit(Request(prompt=prompt_of(10), max_tokens=24, params=SamplingParams(temperature=0.8, seed=3, reproducible=reproducible)))
    while eng.has_work:
        eng.step()
    both = [r for r in eng.policy.reports if r[0] == 2 and len(r[1]) == 2]
    assert both and all(len(row) == 2 for _, _, chances, _ in both for row in chances)
    sampled = []
    for _, kept, chances, requests in both:
        g = requests.index(greedy)
        assert chances[g][: kept[g] + 1] == [1.0] * kept[g] + [0.0] * (kept[g] < 2)
        sampled += chances[1 - g][: kept[1 - g] + 1]
    assert any(0.0 < c < 1.0 for c in sampled)
