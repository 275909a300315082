"""Pipelined drafting cycles (`pipeline_drafts`, on shape-stable caches): each cycle is built on
the previous one before that one is read (cycle.launch_after), its rollback and the head's
inputs taken from device arrays. Output stays mlx-lm's own, token for token."""

import pytest
from engine_helpers import loaded, oracle_hook, prompt_of, reference_greedy

from mlxmtp.engine import cycle
from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.params import SamplingParams


def _count_chained(monkeypatch):
    calls = []
    launch_after = cycle.launch_after

    def spy(*args, **kwargs):
        calls.append(args[3])  # the depth of the cycle built
        return launch_after(*args, **kwargs)

    monkeypatch.setattr(cycle, "launch_after", spy)
    return calls


def _run(eng, reqs, join_every=0):
    got = {r.id: [] for r in reqs}
    reasons = {}
    for i, r in enumerate(reqs):
        eng.submit(r)
        for _ in range(i * join_every):
            for ev in eng.step():
                got[ev.request_id] += ev.token_ids
                reasons[ev.request_id] = ev.finish_reason
    while eng.has_work:
        for ev in eng.step():
            got[ev.request_id] += ev.token_ids
            reasons[ev.request_id] = ev.finish_reason
    return got, reasons


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_6_moe"])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 3])
def test_pipelined_cycles_give_mlx_lms_greedy_output(fixture_model, monkeypatch, family, k, batch):
    model, tok, ref = loaded(str(fixture_model(family)["hf"]))
    chained = _count_chained(monkeypatch)
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=k, pipeline_drafts=True))
    reqs = [Request(prompt=prompt_of(6 + 17 * b, seed=b), max_tokens=30 + 7 * b) for b in range(batch)]
    want = {r.id: reference_greedy(ref, r.prompt, r.max_tokens) for r in reqs}
    eng.draft_hook = oracle_hook(want, p_correct=0.6, seed=k)
    got, _ = _run(eng, reqs, join_every=2)
    assert got == want
    assert len(chained) > 10 and max(chained) == k  # (fewer drafts near a request's end)


def test_adaptive_depth_and_plain_stretches_pipelined(fixture_model, monkeypatch):
    """The policy switches depths (and to plain decoding) between pipelined cycles."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    chained = _count_chained(monkeypatch)
    eng = BatchGenerator(model, tok, EngineConfig(pipeline_drafts=True))
    depths = iter([2, 2, 3, 3, 1, 0, 0, 4, 4, 4, 2, 0, 3] * 20)
    # The model's policy is shared by its engines: patched for this test only.
    monkeypatch.setattr(eng.policy, "choose",
                        lambda *a, **kw: min(next(depths), a[1] if len(a) > 1 and a[1] is not None else 8))
    reqs = [Request(prompt=prompt_of(n, seed=n), max_tokens=60) for n in (5, 40)]
    want = {r.id: reference_greedy(ref, r.prompt, r.max_tokens) for r in reqs}
    eng.draft_hook = oracle_hook(want, p_correct=0.7, seed=3)
    got, _ = _run(eng, reqs)
    assert got == want
    assert len(set(chained)) >= 3  # chains started from cycles of several depths


def test_stops_inside_pipelined_cycles(fixture_model):
    """A row that ends inside a cycle (stop token, stop string, max_tokens) leaves while the
    cycle built on it is in flight; the others are unaffected."""
    model, tok, ref = loaded(str(fixture_model("qwen3_next")["hf"]))
    prompts = [prompt_of(n, seed=n) for n in (8, 21, 34)]
    full = [reference_greedy(ref, p, 40) for p in prompts]
    reqs = [Request(prompt=prompts[0], max_tokens=40, stop_token_ids=[full[0][13]]),
            Request(prompt=prompts[1], max_tokens=17),
            Request(prompt=prompts[2], max_tokens=40)]
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=4, pipeline_drafts=True))
    eng.draft_hook = oracle_hook({r.id: f for r, f in zip(reqs, full)}, p_correct=0.9, seed=5)
    got, reasons = _run(eng, reqs)
    assert got[reqs[0].id] == full[0][: full[0].index(full[0][13]) + 1] and reasons[reqs[0].id] == "stop"
    assert got[reqs[1].id] == full[1][:17] and reasons[reqs[1].id] == "length"
    assert got[reqs[2].id] == full[2]


def test_cancel_and_join_while_pipelined(fixture_model):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=3, pipeline_drafts=True))
    a, b = Request(prompt=prompt_of(9, seed=1), max_tokens=50), Request(prompt=prompt_of(30, seed=2), max_tokens=50)
    want = {r.id: reference_greedy(ref, r.prompt, 50) for r in (a, b)}
    eng.draft_hook = oracle_hook(want, p_correct=0.8, seed=2)
    got = {a.id: [], b.id: []}
    eng.submit(a)
    for _ in range(6):
        for ev in eng.step():
            got[ev.request_id] += ev.token_ids
    eng.submit(b)
    for _ in range(5):
        for ev in eng.step():
            got[ev.request_id] += ev.token_ids
    eng.cancel(a.id)
    while eng.has_work:
        for ev in eng.step():
            got[ev.request_id] += ev.token_ids
    assert got[b.id] == want[b.id]
    assert got[a.id] == want[a.id][: len(got[a.id])] and len(got[a.id]) < 50


def test_mixed_greedy_and_sampled_rows_pipelined(fixture_model, monkeypatch):
    """Sampled rows pipeline too (rejection sampling on the device); a seeded one repeats
    itself, and a greedy row beside it still gives mlx-lm's output."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    chained = _count_chained(monkeypatch)

    def batch():
        return [Request(prompt=prompt_of(12, seed=4), max_tokens=40, params=SamplingParams(temperature=0.8, seed=11)),
                Request(prompt=prompt_of(20, seed=5), max_tokens=40)]

    runs = []
    for _ in range(2):
        reqs = batch()
        got, _ = _run(BatchGenerator(model, tok, EngineConfig(num_draft=2, pipeline_drafts=True)), reqs)
        assert got[reqs[1].id] == reference_greedy(ref, reqs[1].prompt, 40)
        runs.append(got[reqs[0].id])
    assert runs[0] == runs[1] and len(runs[0]) == 40
    assert chained
