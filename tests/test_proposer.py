"""The engine runs any drafter behind the `Proposer` interface (engine/proposers/base.py):
model-free drafters plugged in through it give mlx-lm's greedy output, and a draft proposed
outright (q = a point mass) is kept with probability p(x), its rejection resampling from p
with x removed."""

import math

import mlx.core as mx
import pytest
from engine_helpers import loaded, prompt_of, reference_greedy

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.proposers.base import Drafts, Proposer, point_mass
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.rejection import accept_sampled_rows

N = 24  # tokens per request: enough cycles at every depth, fast on the fixture model


class ReplayProposer(Proposer):
    """Proposes a known continuation (request id -> mlx-lm's greedy output), every third
    draft made wrong, so acceptance lengths vary; a fixed token for requests it does not know.
    Model-free: q is a point mass on each draft (only sampled rows would read it)."""

    def __init__(self, known: dict, vocab_size: int):
        self.known, self.vocab_size = known, vocab_size
        self.calls = 0

    def propose(self, batch, rows, k, pick):
        self.calls += 1
        out = []
        for row in rows:
            want = self.known.get(row.req.id, [])
            nxt = [want[row.generated + j] if row.generated + j < len(want) else 7 for j in range(k)]
            out.append([t if (row.generated + j) % 3 else (t + 1) % self.vocab_size for j, t in enumerate(nxt)])
        tokens = mx.array(out, dtype=mx.int32)
        return Drafts(tokens, point_mass(tokens, self.vocab_size))


def _run(model, tok, prompts, k, known_ids):
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=k))
    reqs = [Request(prompt=p, max_tokens=N) for p in prompts]
    for r in reqs:
        eng.submit(r)
    eng.proposer = ReplayProposer({}, eng.vocab_size)  # plugged in through the interface alone
    got = {r.id: [] for r in reqs}
    stats = {}
    while eng.has_work:
        eng.proposer.known = {r.id: w for r, w in zip(reqs, known_ids(reqs))}
        for ev in eng.step():
            got[ev.request_id] += ev.token_ids
            if ev.stats is not None:
                stats[ev.request_id] = ev.stats
    return [got[r.id] for r in reqs], [stats[r.id] for r in reqs], eng


@pytest.mark.parametrize("k", [1, 3])
def test_any_proposer_gives_mlx_lm_greedy_output(fixture_model, k):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    prompts = [prompt_of(5, seed=1), prompt_of(9, seed=2)]
    want = [reference_greedy(ref, p, N) for p in prompts]
    # The first row's drafts replay its continuation; the second's are a fixed token.
    got, stats, eng = _run(model, tok, prompts, k, lambda reqs: [want[0]])
    assert got == want
    assert eng.proposer.calls > 0
    assert stats[0].accepted > 0 and stats[0].drafted >= stats[0].accepted
    assert stats[0].drafted_by_position[k - 1] > 0  # drafted at every depth up to k


def test_a_point_mass_draft_is_kept_with_probability_p():
    """q = a point mass on x: draft x is kept iff u < p(x) (min(1, p/q) = p(x)); on a
    rejection the next token comes from p with x removed, renormalised."""
    p = mx.log(mx.array([[[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]]]))  # [S=1, k+1=2, V=3]
    drafts = mx.array([[1]], dtype=mx.int32)
    q = point_mass(drafts, 3)
    assert q[0, 0].tolist() == [-math.inf, 0.0, -math.inf]
    no_noise = mx.zeros((1, 3))
    kept, tokens = accept_sampled_rows(p, q, drafts, mx.array([[0.29]]), no_noise)
    assert kept.tolist() == [1] and tokens.tolist() == [[1, 2]]  # kept; the bonus from p
    # Rejected: with x = 1 removed, the residual is (0.5, 0, 0.2); Gumbel noise that favours
    # token 1 cannot bring it back.
    favour_x = mx.array([[0.0, 50.0, 0.0]])
    kept, tokens = accept_sampled_rows(p, q, drafts, mx.array([[0.31]]), favour_x)
    assert kept.tolist() == [0] and tokens[0, 0].item() == 0
