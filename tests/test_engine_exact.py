"""The master test: with MTP on, greedy output equals mlx-lm's own greedy output,
token for token, for every family, depth and prompt length (float32 fixtures)."""

import mlx.core as mx
import mlx_lm
import pytest
from engine_helpers import loaded, oracle_hook, prompt_of, reference_greedy

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.generate import generate
from mlxmtp.engine.request import Request
from mlxmtp.models.load import load
from mlxmtp.testing.fixtures import FAMILIES, write_hf_checkpoint

DEPTHS = [0, 1, 2, 3, 4, None]  # 0 = MTP off, None = adaptive


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_identity_every_depth(fixture_model, family):
    """Every depth (MTP off, 1-4, adaptive) on two prompts: 60 tokens drafted by the random
    head itself (its drafts are rejected: each cycle verifies k + 1 tokens and rolls back all
    k), and 140 tokens whose drafts are forced right with p = 0.7 (the head still runs), so
    every acceptance length 0..k occurs and every rollback path runs."""
    model, tok, ref = loaded(str(fixture_model(family)["hf"]))
    own, forced = prompt_of(1, seed=1), prompt_of(37, seed=37)
    want_own, want_forced = reference_greedy(ref, own, 60), reference_greedy(ref, forced, 140)
    for k in DEPTHS:
        got = generate(model, tok, own, max_tokens=60, config=EngineConfig(num_draft=k)).token_ids
        assert got == want_own, f"{family} own drafts k={k}"
        got, stats, _ = _run_forced(model, tok, forced, want_forced, k, 0.7, seed=k or 0)
        assert got == want_forced, f"{family} forced drafts k={k}"
        if k:  # a fixed depth: the patterns really were ragged, and paid
            s = stats.as_dict()
            assert 0.3 < s["acceptance"] < 0.95 and s["tokens_per_forward"] > 1.2, (k, s)
            # Every acceptance length 0..k occurred: a draft rejected at every position, and
            # a cycle that kept all k.
            reached, kept = stats.drafted_by_position, stats.accepted_by_position
            assert all(reached[j] > kept[j] for j in range(k)) and kept[k - 1] > 0, (k, reached, kept)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_6_moe"])
def test_greedy_identity_long_prompt_chunked(fixture_model, family):
    """600-token prompt, prefilled in chunks of 256 (head inputs paired across chunks)."""
    model, tok, ref = loaded(str(fixture_model(family)["hf"]))
    prompt = prompt_of(600, seed=600)
    want = reference_greedy(ref, prompt, 200)
    for k in (2, None):
        res = generate(model, tok, prompt, max_tokens=200, config=EngineConfig(num_draft=k, prefill_step=256))
        assert res.token_ids == want


def _run_forced(model, tok, prompt, want, k, p_correct, seed, **kw):
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=k, **kw))
    req = Request(prompt=prompt, max_tokens=len(want))
    eng.submit(req)
    eng.draft_hook = oracle_hook({req.id: want}, p_correct=p_correct, seed=seed)
    got, events = [], []
    while eng.has_work:
        for ev in eng.step():
            got += ev.token_ids
            events.append(ev)
    return got, events[-1].stats, eng


def test_all_drafts_accepted_gives_k_plus_one_tokens_per_forward(fixture_model):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    prompt = prompt_of(10)
    want = reference_greedy(ref, prompt, 61)
    got, stats, _ = _run_forced(model, tok, prompt, want, 3, 1.0, seed=0)
    assert got == want
    assert stats.as_dict()["acceptance"] == 1.0
    assert stats.as_dict()["tokens_per_forward"] == 4.0


def test_prefill_chunks_never_compute_the_lm_head(tmp_path):
    """As in mlx-lm's prefill, the chunks before a prompt's last token evaluate the caches
    alone: with a 64K vocabulary a 512-token chunk's logits would take 128 MiB. Output
    stays mlx-lm's own."""
    path = str(write_hf_checkpoint(tmp_path / "model", "qwen3_5", vocab_size=65536))
    model, tok = load(path)
    ref, _ = mlx_lm.load(path)
    prompt = prompt_of(600, seed=3)
    generate(model, tok, prompt[:20], max_tokens=2, config=EngineConfig(num_draft=1))  # allocations of the first use
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    got = generate(model, tok, prompt, max_tokens=3, config=EngineConfig(num_draft=1, prefill_step=512)).token_ids
    assert mx.get_peak_memory() - base < 512 * 65536 * 4 // 4  # a quarter of one chunk's logits
    assert got == reference_greedy(ref, prompt, 3)
