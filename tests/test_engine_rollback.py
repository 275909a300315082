"""Rollback is exact: after every acceptance pattern the caches equal those of a plain
decoder that never saw the rejected tokens; stops inside drafts end everything at the
emitted tokens."""

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import loaded, oracle_hook, prompt_of, reference_greedy
from mlx_lm.models.cache import make_prompt_cache

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.request import Request
from mlxmtp.mlxlm.ragged_cache import RaggedKVCache


def reference_cache(ref_model, tokens):
    cache = make_prompt_cache(ref_model)
    ref_model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def assert_caches_equal(engine_cache, ref_cache, row=0):
    for mine, theirs in zip(engine_cache, ref_cache):
        if isinstance(mine, RaggedKVCache):
            n = mine.lengths[row]
            assert n == theirs.offset
            k, v = theirs.keys[..., :n, :], theirs.values[..., :n, :]
            np.testing.assert_allclose(np.array(mine.keys[row : row + 1, :, :n]), np.array(k), atol=1e-4)
            np.testing.assert_allclose(np.array(mine.values[row : row + 1, :, :n]), np.array(v), atol=1e-4)
        else:
            for a, b in zip(mine.cache, theirs.cache):
                np.testing.assert_allclose(np.array(a[row : row + 1]), np.array(b), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_6_moe"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("mode", ["sliced", "shape_stable", "pipelined"])
def test_caches_match_plain_decoder_after_every_cycle(fixture_model, family, batch, mode):
    model, tok, ref = loaded(str(fixture_model(family)["hf"]))
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=3, shape_stable=mode != "sliced",
                                                  pipeline_drafts=mode == "pipelined"))
    wants = {}
    for b in range(batch):
        prompt = prompt_of(9 + 5 * b, seed=b)
        req = Request(prompt=prompt, max_tokens=40)
        wants[req.id] = reference_greedy(ref, prompt, 40)
        eng.submit(req)
    eng.draft_hook = oracle_hook(wants, p_correct=0.6, seed=1)
    checked = 0
    while eng.has_work:
        eng.step()
        # A pipelined cycle in flight has already fed more tokens: read it, then check (with
        # shape-stable caches that cycle was built on the one before it, unread).
        if eng.rows and eng.cycles % 2 == 0:
            eng.flush()
            for i, row in enumerate(eng.rows):
                # Everything but the last emitted token has been fed to the main model.
                assert_caches_equal(eng.cache, reference_cache(ref, row.tokens[:-1]), row=i)
                checked += 1
    assert checked >= 10


def test_stop_string_inside_accepted_draft(fixture_model):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    prompt = prompt_of(12, seed=3)
    want = reference_greedy(ref, prompt, 40)
    full_text = tok.decode(want)
    # A stop string that completes at a token in the middle of a cycle's drafts.
    stop = full_text[len(tok.decode(want[:9])) : len(tok.decode(want[:11]))]
    assert stop
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=4))
    req = Request(prompt=prompt, max_tokens=40, stop=[stop])
    eng.submit(req)
    eng.draft_hook = oracle_hook({req.id: want}, p_correct=1.0)
    text, ids, reason, last_cache, fired = "", [], None, None, None
    while eng.has_work:
        if eng.cache is not None:
            last_cache = eng.cache
        for ev in eng.step():
            text += ev.text
            ids += ev.token_ids
            reason = ev.finish_reason or reason
            fired = ev.stop or fired
    assert reason == "stop" and fired == stop
    assert stop not in text
    assert full_text.startswith(text + stop)
    assert ids == want[: len(ids)] and len(ids) < 40
    # Nothing past the stop was kept: the caches end at the emitted tokens.
    expect = len(prompt) + len(ids) - 1
    for c in last_cache:
        if isinstance(c, RaggedKVCache):
            assert c.lengths == [expect]


def test_eos_inside_draft_and_max_tokens_mid_draft(fixture_model):
    model, tok, ref = loaded(str(fixture_model("qwen3_next")["hf"]))
    prompt = prompt_of(12, seed=4)
    want = reference_greedy(ref, prompt, 40)
    eos = want[13]
    first = want.index(eos)
    for stop_ids, max_tokens, expected in (([eos], 40, want[: first + 1]), ([], 7, want[:7])):
        eng = BatchGenerator(model, tok, EngineConfig(num_draft=4))
        req = Request(prompt=prompt, max_tokens=max_tokens, stop_token_ids=stop_ids)
        eng.submit(req)
        eng.draft_hook = oracle_hook({req.id: want}, p_correct=1.0)
        ids, reason = [], None
        while eng.has_work:
            for ev in eng.step():
                ids += ev.token_ids
                reason = ev.finish_reason or reason
        assert ids == expected
        assert reason == ("stop" if stop_ids else "length")


def test_head_inputs_are_dropped_while_plain_decoding_and_drafting_resumes_exactly(fixture_model):
    # While the policy's regime is plain decoding the head is not kept current (that costs
    # a head pass per token): its pending inputs stay bounded. Drafting afterwards still
    # gives mlx-lm's greedy output, and with right drafts still accepts them.
    from engine_helpers import loaded, oracle_hook, prompt_of, reference_greedy

    from mlxmtp.engine.batch import BatchGenerator
    from mlxmtp.engine.policy.base import Policy
    from mlxmtp.engine.proposers.mtp_inputs import FORGET_AFTER
    from mlxmtp.engine.request import Request

    class Plain80ThenDraft(Policy):
        regime = 0

        def __init__(self):
            self.n = 0

        def choose(self, batch_size, limit=None, classes=None, requests=None):
            self.n += 1
            if self.n > 80:
                self.regime = 2
            return min(self.regime, limit if limit is not None else 8)

        def update(self, *args, **kwargs):
            pass

        def plain_regime(self):
            return self.regime == 0

    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    prompt = prompt_of(30, seed=4)
    expected = reference_greedy(ref, prompt, 140)
    eng = BatchGenerator(model, tok)
    eng.policy = Plain80ThenDraft()
    rid = eng.submit(Request(prompt=prompt, max_tokens=140))
    eng.draft_hook = oracle_hook({rid: expected}, p_correct=1.0)
    out, most_pending, stats = [], 0, None
    while eng.has_work:
        for ev in eng.step():
            out += ev.token_ids
            stats = ev.stats or stats
        if eng.rows:
            most_pending = max(most_pending, len(eng.rows[0].pend_t))
        if eng.policy.n == 80:
            head_len = eng.head_cache[0].lengths[0]  # the head saw the prompt, nothing since
    assert head_len <= len(prompt)
    assert out == expected
    assert most_pending <= FORGET_AFTER + 1  # a probe starts with a head pass over them
    assert stats.accepted == stats.drafted > 0


def test_the_earliest_stop_string_is_reported(fixture_model):
    """Several stop strings: the one that ends first in the text ends the request, and the
    final event names it (the server reports it as Anthropic's stop_sequence)."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    prompt = prompt_of(12, seed=3)
    want = reference_greedy(ref, prompt, 40)
    full = tok.decode(want)
    early = full[len(tok.decode(want[:6])) : len(tok.decode(want[:8]))]
    late = full[len(tok.decode(want[:20])) : len(tok.decode(want[:23]))]
    assert early and late and early not in full[: len(tok.decode(want[:6]))]
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=3))
    req = Request(prompt=prompt, max_tokens=40, stop=[late, early])
    eng.submit(req)
    events = []
    while eng.has_work:
        events += eng.step()
    assert events[-1].finish_reason == "stop" and events[-1].stop == early
    assert all(ev.stop is None for ev in events[:-1])
    assert "".join(ev.text for ev in events) == full[: full.index(early)]
