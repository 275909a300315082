"""A seeded request gives the same text whatever the draft depth, the batch and the
pipelining, and the same as with MTP off (engine/sampling/seeded.py); its tokens are still
samples of the model's distribution."""

import pytest
from engine_helpers import loaded, oracle_hook, prompt_of
from test_memory_guard import _budget_for
from test_sampling_exact import chi2_quantile, chi2_two_sample

from mlxmtp.engine import memory
from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.mlxlm.ragged_cache import RaggedKVCache
from mlxmtp.models.demo import demo_model_path

PROMPT = prompt_of(12, seed=4)
SETTINGS = {
    "temperature": dict(temperature=0.9),
    "filtered": dict(temperature=0.8, top_p=0.9, top_k=40),
    "penalty": dict(temperature=0.9, repetition_penalty=1.2),  # decided row by row
}


def _mine(settings, seed=11, reproducible=True, max_tokens=40):
    params = SamplingParams(**SETTINGS[settings], seed=seed, reproducible=reproducible)
    return Request(prompt=PROMPT, max_tokens=max_tokens, params=params)


def _others():
    """Rows of every kind to share a batch with: greedy, sampled without a seed, filtered
    with a seed of its own (not reproducible), and one with a logits processor."""
    return [Request(prompt=prompt_of(5, seed=1), max_tokens=30),
            Request(prompt=prompt_of(30, seed=2), max_tokens=25, params=SamplingParams(temperature=1.1)),
            Request(prompt=prompt_of(9, seed=3), max_tokens=35, params=SamplingParams(temperature=0.7, top_p=0.8, seed=5)),
            Request(prompt=prompt_of(3, seed=6), max_tokens=20,
                    params=SamplingParams(temperature=1.0, presence_penalty=0.5))]


def _run(model, tok, requests, hook_expected=None, max_batch=8, **options):
    return _outputs(BatchGenerator(model, tok, EngineConfig(max_batch=max_batch, **options)), requests, hook_expected)


def _outputs(eng, requests, hook_expected=None):
    """Each request's tokens, run to the end on `eng` (the drafts of the first
    len(hook_expected) forced to those outputs with some wrong, when given)."""
    ids = [eng.submit(r) for r in requests]
    if hook_expected is not None:
        eng.draft_hook = oracle_hook(dict(zip(ids, hook_expected)), p_correct=0.6, seed=3)
    out = {i: [] for i in ids}
    while eng.has_work:
        for ev in eng.step():
            out[ev.request_id] += ev.token_ids
    return [out[i] for i in ids]


ARMS = {
    "k=1": dict(enable_mtp=True, num_draft=1),
    "k=2": dict(enable_mtp=True, num_draft=2),
    "k=4": dict(enable_mtp=True, num_draft=4),
    "adaptive": dict(enable_mtp=True),
    "pipelined k=3": dict(enable_mtp=True, num_draft=3, pipeline_drafts=True, shape_stable=True),
    "compiled k=3": dict(enable_mtp=True, num_draft=3, compile_steps=True, shape_stable=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_seeded_requests_give_the_same_text_at_every_depth_and_in_any_batch(fixture_model, family):
    """At every arm, the three kinds of seeded row (SETTINGS) in one batch with rows of every
    other kind (_others), and one of them alone (each kind alone at two arms): the text is
    plain decoding's."""
    model, tok, _ = loaded(str(fixture_model(family)["hf"]))
    plain = [_run(model, tok, [_mine(s)], enable_mtp=False)[0] for s in SETTINGS]
    assert all(len(text) == 40 for text in plain)

    def batch():
        return [*(_mine(s) for s in SETTINGS), *_others()]

    alone = list(zip(SETTINGS, plain))
    for i, (name, options) in enumerate(ARMS.items()):
        s, want = alone[i % len(alone)]
        assert _run(model, tok, [_mine(s)], **options)[0] == want, (name, s)
        assert _run(model, tok, batch(), **options)[:3] == plain, name
    # Drafts right 60% of the time (the head of a random fixture is rarely right), so
    # every acceptance length and rollback occurs.
    assert _run(model, tok, batch(), hook_expected=plain, enable_mtp=True, num_draft=3)[:3] == plain
    assert _run(model, tok, [_mine("temperature", seed=12)], enable_mtp=False)[0] != plain[0]


@pytest.mark.slow
@pytest.mark.parametrize("options", [dict(num_draft=3), dict(num_draft=2, pipeline_drafts=True)],
                         ids=["k=3", "pipelined k=2"])
def test_a_seeded_request_sent_back_to_wait_for_memory_resumes_the_same_text(fixture_model, monkeypatch, options):
    """Two rows fit at first, one once they grow (test_memory_guard): the newer one is sent
    back, prefilled again later, and its text is still plain decoding's with its seed."""
    monkeypatch.setattr(memory, "ADMIT_HEADROOM", 0)
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    n = 300

    def requests():
        return [Request(prompt=prompt_of(20 + 4 * i, seed=21 + i), max_tokens=n,
                        params=SamplingParams(temperature=0.9, seed=i, reproducible=True)) for i in range(2)]

    plain = _run(model, tok, requests(), enable_mtp=False)
    eng = BatchGenerator(model, tok, EngineConfig(memory_bytes=_budget_for(model, 2, RaggedKVCache.step),
                                                  prefill_step=64, **options))
    assert _outputs(eng, requests()) == plain
    assert eng.memory.preempted == 1


@pytest.mark.slow
def test_the_demo_model_too_and_a_seed_without_reproducible_draws_differs_by_depth():
    """On the trained demo model (float16, drafts mostly right); and the engine-level
    seed without `reproducible` (repeatable draws only) gives other text at another depth,
    which is what the reproducible rule is for."""
    model, tok, _ = loaded(str(demo_model_path()))
    prompt = tok.encode("def fibonacci(n):")
    def request(reproducible):
        return Request(prompt=prompt, max_tokens=48,
                       params=SamplingParams(temperature=0.7, seed=3, reproducible=reproducible))
    plain = _run(model, tok, [request(True)], enable_mtp=False)[0]
    for k in (1, 2, 3, 4):
        assert _run(model, tok, [request(True)], enable_mtp=True, num_draft=k)[0] == plain, k
    assert _run(model, tok, [request(True)], enable_mtp=True)[0] == plain
    free = {k: _run(model, tok, [request(False)], enable_mtp=k > 0, num_draft=k or None)[0] for k in (0, 3)}
    assert free[0] != free[3]


@pytest.mark.slow
def test_seeded_tokens_are_samples_of_the_model_s_distribution(fixture_model):
    """Over many seeds, the first tokens of reproducible requests drafted at k = 3 follow
    the same distribution as plain sampling (two-sample chi-square at 99.9%, at each of the
    first three positions: the draws of different positions must be independent too)."""
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    n = 800

    def sample(reproducible, **options):
        # No stop tokens: an end token sampled (p ~ 2e-5 a draw here) is one more token of the
        # distributions compared, not a request that ends before its third position.
        # The plain draws are seeded too (their own seeds, not reproducible): a statistical
        # test on unseeded draws fails one run in a few hundred, at random.
        reqs = [Request(prompt=PROMPT, max_tokens=3, stop_token_ids=[],
                        params=SamplingParams(temperature=0.5, seed=s if reproducible else n + s,
                                              reproducible=reproducible))
                for s in range(n)]
        return _run(model, tok, reqs, max_batch=64, prefix_cache_bytes=64 << 20, **options)

    seeded = sample(True, enable_mtp=True, num_draft=3)
    free = sample(False, enable_mtp=False)
    for pos in (0, 1, 2):
        stat, dof = chi2_two_sample([o[pos] for o in seeded], [o[pos] for o in free])
        assert stat < chi2_quantile(dof), (pos, stat, dof)
    # As varied as free sampling (keys shared across seeds would repeat whole outputs).
    assert len({tuple(o) for o in seeded}) > 0.8 * len({tuple(o) for o in free})


@pytest.mark.parametrize("settings", ["temperature", "penalty"])  # the vectorised and the row-by-row accept
def test_reproducible_rows_build_no_rejection_sampling(fixture_model, monkeypatch, settings):
    """Rejection sampling's random numbers are built only where a row is decided by it: a
    batch of reproducible rows (and greedy ones) makes none, and still gives MTP off's text."""
    from mlxmtp.engine.sampling import batch as sampling_batch

    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    plain = _run(model, tok, [_mine(settings)], enable_mtp=False)[0]
    calls = []
    real = sampling_batch.rows_noise
    monkeypatch.setattr(sampling_batch, "rows_noise", lambda *a: calls.append(1) or real(*a))
    greedy = Request(prompt=prompt_of(5, seed=1), max_tokens=30)
    assert _run(model, tok, [_mine(settings), greedy], enable_mtp=True, num_draft=3)[0] == plain
    assert not calls
    unseeded = Request(prompt=prompt_of(30, seed=2), max_tokens=25, params=SamplingParams(**SETTINGS[settings]))
    assert _run(model, tok, [_mine(settings), unseeded], enable_mtp=True, num_draft=3)[0] == plain
    assert calls  # the same batch with a row that rejection sampling decides builds them
