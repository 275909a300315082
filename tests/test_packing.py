"""A verify whose rows carry different numbers of real tokens computes the per-token layers on
those only (mlxlm/packing.py): each row's real positions get what the padded forward gives
them, the caches roll back alike, and the cycle keeps no draft past a row's own. The hybrid
plan packs where its prices say a verify's tokens cost their compute (proposers/prices.py)."""

from contextlib import nullcontext
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import loaded, oracle_hook, prompt_of, reference_greedy

from mlxmtp.engine import cycle
from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.policy.base import OPENING_TOKENS
from mlxmtp.engine.proposers import hybrid_plan
from mlxmtp.engine.proposers.prices import Prices
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.engine.suffix_index import Draft
from mlxmtp.mlxlm import adapter, gdn_capture, packing


def _verify(parts, prompts, T, lengths, pack):
    """A prefill of `prompts` and a T-token forward of every row on top, packed to each row's
    first lengths[b] tokens or padded: (logits, hidden, each row's caches after it keeps those)."""
    cache = adapter.make_cache(parts, len(prompts))
    mx.eval(adapter.forward(parts, mx.array(prompts), cache)[0])
    tokens = mx.array([[(7 * b + t) % 290 for t in range(T)] for b in range(len(prompts))])
    with gdn_capture.record() as rec, packing.real_tokens(lengths, T) if pack else nullcontext():
        logits, hidden = adapter.forward(parts, tokens, cache)
    mx.eval(logits, hidden, *cache.arrays())
    cache.commit(rec.layers, lengths, T)
    rows = [cache.extract_row(b).to_state("c") for b in range(len(prompts))]
    return logits, hidden, [({n: np.array(a) for n, a in arrays.items()}, meta) for arrays, meta in rows]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_6_moe"])
def test_each_rows_real_positions_get_what_the_padded_forward_gives(fixture_model, family):
    model, _, _ = loaded(str(fixture_model(family)["hf"]))
    parts = model.parts
    adapter.prepare_model(parts.text_model)
    prompts, lengths, T = [prompt_of(12, seed=1), prompt_of(12, seed=2), prompt_of(12, seed=3)], [9, 2, 4], 9
    padded = _verify(parts, prompts, T, lengths, pack=False)
    packed = _verify(parts, prompts, T, lengths, pack=True)
    for b, n in enumerate(lengths):
        for a, p in zip(padded[:2], packed[:2]):
            np.testing.assert_allclose(np.array(p[b, :n]), np.array(a[b, :n]), rtol=1e-5, atol=1e-5)
        assert not np.any(np.array(packed[0][b, n:]))  # the padded positions' logits were not computed
        # Each row's caches after keeping its real tokens: the padding left nothing behind.
        (want, want_meta), (got, got_meta) = padded[2][b], packed[2][b]
        assert got_meta == want_meta and got.keys() == want.keys()
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_packing_is_used_where_padding_is_a_large_share_of_the_verify():
    assert cycle.real_lengths([("suffix", 16), ("mtp", 3), ("mtp", 3), ("mtp", 3)], 16) == [17, 4, 4, 4]
    assert cycle.real_lengths([("mtp", 3)] * 4, 3) is None  # the head's own cycle: no padding
    assert cycle.real_lengths([("suffix", 8), ("suffix", 7)], 8) is None  # one token of padding
    assert cycle.real_lengths([], 0) is None and cycle.real_lengths(None, 3) is None


def test_a_packed_verify_keeps_no_draft_past_a_rows_own(fixture_model, monkeypatch):
    """Row 1 drafts one token a cycle, padded to the other row's four by tokens a padded
    verify could keep (here: the right ones). Packed, the cycle keeps none of them (their
    logits were not computed) and the output is mlx-lm's; padded, it keeps them."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    prompts = [prompt_of(10, seed=1), prompt_of(12, seed=2)]
    want = [reference_greedy(ref, p, n) for p, n in zip(prompts, (90, 30))]  # row 0 outlasts row 1
    packed = []
    real_tokens = packing.real_tokens
    monkeypatch.setattr(packing, "real_tokens", lambda lengths, T: packed.append(lengths) or real_tokens(lengths, T))

    def run():
        eng = BatchGenerator(model, tok, EngineConfig(num_draft=4))
        reqs = [Request(prompt=p, max_tokens=len(w)) for p, w in zip(prompts, want)]
        for r in reqs:
            eng.submit(r)
        eng.draft_hook = oracle_hook({r.id: w for r, w in zip(reqs, want)}, p_correct=1.0)
        monkeypatch.setattr(eng.proposer, "drafted", lambda n, k: [("mtp", k)] + [("mtp", min(k, 1))] * (n - 1))
        monkeypatch.setattr(eng.proposer, "packs", lambda: True)
        got, stats = {r.id: [] for r in reqs}, {}
        while eng.has_work:
            for ev in eng.step():
                got[ev.request_id] += ev.token_ids
                if ev.stats is not None:
                    stats[ev.request_id] = ev.stats.as_dict()
        return [got[r.id] for r in reqs], [stats[r.id]["tokens_per_forward"] for r in reqs]

    got, per_forward = run()
    assert got == want and packed and per_forward[1] <= 2.0 < per_forward[0]
    monkeypatch.setattr(packing, "MIN_PADDING", 2.0)  # never packs
    packed.clear()
    got, per_forward = run()
    assert got == want and not packed and per_forward[1] > 2.0


class _Policy:
    """Scripted estimates: each head draft kept with probability 0.05; a cycle of depth k costs
    1 + slope * k plain cycles (a batch whose verify grows with its tokens)."""

    def __init__(self, slope):
        self.slope, self.calls = slope, 0

    def expected_tokens(self, optimistic=False, classes=(None,)):
        return [sum(0.05**i for i in range(j + 1)) for j in range(5)]

    def relative_costs(self, batch_size, classes, depths, cautious=False):
        self.calls += 1
        return {k: 1 + self.slope * k for k in depths}


def _row(i):
    sampler = SimpleNamespace(params=SamplingParams(temperature=0), reproducible=False)
    return SimpleNamespace(req=SimpleNamespace(id=i, num_draft=None), sampler=sampler, generated=OPENING_TOKENS)


def test_a_verify_is_packed_where_the_prices_say_its_tokens_cost_their_compute():
    """One row's 16-token suffix draft beside three rows' 3 head drafts, priced as a cycle of
    depth 16 either way: packed where each verified token costs a tenth of a plain cycle (its
    padding then costs more than a verify without it would, by far), not where tokens cost next
    to nothing (a GPU reading the weights: the gathers would cost more than they save)."""
    lengths = [17, 4, 4, 4]
    d = packing.equivalent_depth(lengths, 16)
    assert d == pytest.approx(16 - packing.SAVED * (68 - 29) / 4)
    policy = _Policy(slope=0.1)
    steep = Prices(policy, 4, [None] * 4, [3, 16], 3, 4)
    assert steep.verify(16, lengths) == (pytest.approx(2.6), True)
    assert steep.verify(16, [17] * 4) == (pytest.approx(2.6), False)  # no padding
    assert policy.calls == 2  # one call for the prices, one for the doubted ones: each a collective across machines
    flat = Prices(_Policy(slope=0.005), 4, [None] * 4, [3, 16], 3, 4)
    assert flat.verify(16, lengths) == (pytest.approx(1.08), False)


def test_the_plan_packs_a_copying_rows_long_verify_beside_rows_left_to_the_head(monkeypatch):
    """Four rows decoding plainly, one of them copying (a sure 16-token draft), each verified
    token costing 0.1 of a plain cycle: the copying row drafts, the others are padded, and the
    plan says the verify packs them."""
    rows, none = [_row(i) for i in range(4)], Draft([], [], 0)
    proposals = [Draft(list(range(16)), [0.99 ** (i + 1) for i in range(16)], 16)] + [none] * 3
    plan = hybrid_plan.choose(0, rows, proposals, _Policy(slope=0.1), hybrid_plan.Calibration(), 32)
    assert plan.depth > 4 and plan.suffix_rows(rows) == [True, False, False, False] and plan.packed
    monkeypatch.setattr(packing, "MIN_PADDING", 2.0)  # never packs
    again = hybrid_plan.choose(0, rows, proposals, _Policy(slope=0.1), hybrid_plan.Calibration(), 32)
    assert again == plan and not again.packed
