"""Top-n log-probabilities: mlx-lm's own distribution at every emitted position, whatever
the draft depth and the batch, most likely first."""

import mlx.core as mx
import pytest
from engine_helpers import loaded, oracle_hook, prompt_of
from mlx_lm.generate import generate_step

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.params import SamplingParams


def reference_logprobs(ref_model, prompt, n):
    out = []
    for tok, lp in generate_step(mx.array(prompt), ref_model, max_tokens=n):
        out.append((int(tok), lp))
        if len(out) == n:
            break
    return out


def collect(eng, requests):
    for r in requests:
        eng.submit(r)
    got = {r.id: [] for r in requests}
    while eng.has_work:
        for ev in eng.step():
            got[ev.request_id] += ev.logprobs or []
    return got


@pytest.mark.parametrize("depth,batch,pipelined", [(0, 1, False), (2, 1, False), (4, 3, False), (None, 3, False),
                                                  (3, 3, True)])
def test_top_logprobs_match_mlx_lm_at_every_depth_and_batch(fixture_model, depth, batch, pipelined):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    reqs = [Request(prompt=prompt_of(5 + 11 * i, seed=i), max_tokens=12, logprobs=[5, 0, 20][i % 3])
            for i in range(batch)]
    want = {r.id: reference_logprobs(ref, r.prompt, r.max_tokens) for r in reqs}
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=depth, pipeline_drafts=pipelined))
    if depth:
        eng.draft_hook = oracle_hook({r.id: [t for t, _ in want[r.id]] for r in reqs}, p_correct=0.7, seed=1)
    got = collect(eng, reqs)
    for r in reqs:
        assert [e["token"] for e in got[r.id]] == [t for t, _ in want[r.id]]
        for e, (t, lp) in zip(got[r.id], want[r.id]):
            assert e["logprob"] == pytest.approx(lp[t].item(), abs=1e-4)
            assert len(e["top"]) == r.logprobs
            ids = [i for i, _ in e["top"]]
            values = [v for _, v in e["top"]]
            assert values == sorted(values, reverse=True)
            assert values == pytest.approx([lp[i].item() for i in ids], abs=1e-4)
            if ids:
                assert ids[0] == t  # greedy: the chosen token is the most likely one
                assert values[-1] >= mx.sort(lp)[-len(ids)].item() - 1e-4


def test_top_logprobs_of_sampled_rows_are_of_the_processed_distribution(fixture_model):
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    req = Request(prompt=prompt_of(9, seed=4), max_tokens=10, logprobs=3,
                  params=SamplingParams(temperature=0.7, seed=5, logit_bias={7: 100.0}))
    got = collect(BatchGenerator(model, tok, EngineConfig(num_draft=2)), [req])[req.id]
    assert len(got) == 10
    for e in got:
        assert e["top"][0][0] == 7 and e["top"][0][1] > -1e-3  # the bias makes token 7 near-certain
        assert e["logprob"] <= 0
