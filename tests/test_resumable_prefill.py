"""A request cancelled during its prefill leaves the state it reached in the prefix cache,
so the same request sent again (a client's timeout and retry) resumes there: its prefill
covers only what was left, and its output is what an uninterrupted run gives."""

import pytest
from engine_helpers import loaded, prompt_of, reference_greedy
from server_helpers import served_engine

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.request import Request

CHUNK = 16


def attempt(eng, prompt, steps=None):
    """Submit `prompt`; cancel it after `steps` engine steps (None: run it to its end).
    -> (its tokens, its final stats)."""
    rid = eng.submit(Request(prompt=prompt, max_tokens=12))
    tokens, stats, n = [], None, 0
    while stats is None:
        if steps is not None and n == steps:
            eng.cancel(rid)
        for ev in eng.step():
            if ev.request_id == rid:
                tokens += ev.token_ids
                stats = ev.stats if ev.finish_reason else None
                finish = ev.finish_reason
        n += 1
    assert (finish == "cancelled") == (steps is not None), finish
    return tokens, stats


@pytest.mark.parametrize("family,mtp", [("qwen3_5", True), ("qwen3_next", False)])
def test_a_prefill_cancelled_twice_resumes_where_it_stopped(fixture_model, family, mtp):
    model, tok, ref = loaded(str(fixture_model(family)["hf"]))
    eng = BatchGenerator(model, tok, EngineConfig(enable_mtp=mtp, prefill_step=CHUNK, prefix_cache_bytes=1 << 30))
    prompt = prompt_of(200, seed=3)
    tokens, stats = attempt(eng, prompt, steps=3)  # one chunk per step: cut after 3 chunks
    assert not tokens and stats.cached_prompt_tokens == 0
    tokens, stats = attempt(eng, prompt, steps=4)  # resumes at 3 chunks, cut after 4 more
    assert not tokens and stats.cached_prompt_tokens == 3 * CHUNK
    tokens, stats = attempt(eng, prompt)  # resumes at 7 chunks and finishes
    assert stats.cached_prompt_tokens == 7 * CHUNK
    assert tokens == reference_greedy(ref, prompt, 12)


def test_a_prompt_that_differs_after_the_cut_still_gets_its_own_answer(fixture_model):
    # The kept state is a strict prefix: another prompt sharing it (an edited retry) starts
    # there too, and still decodes exactly its own continuation.
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    eng = BatchGenerator(model, tok, EngineConfig(prefill_step=CHUNK, prefix_cache_bytes=1 << 30))
    prompt = prompt_of(120, seed=5)
    attempt(eng, prompt, steps=4)
    edited = prompt[: 4 * CHUNK] + prompt_of(40, seed=6)
    tokens, stats = attempt(eng, edited)
    assert stats.cached_prompt_tokens == 4 * CHUNK
    assert tokens == reference_greedy(ref, edited, 12)


def test_nothing_is_kept_without_a_prefix_cache(fixture_model):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    eng = BatchGenerator(model, tok, EngineConfig(prefill_step=CHUNK))
    prompt = prompt_of(120, seed=5)
    attempt(eng, prompt, steps=3)
    tokens, stats = attempt(eng, prompt)
    assert stats.cached_prompt_tokens == 0 and tokens == reference_greedy(ref, prompt, 12)


@pytest.mark.slow
def test_a_client_that_times_out_and_retries_finishes(start_server, monkeypatch):
    # The OpenAI SDK's own timeout and retries against a prefill slower than its timeout:
    # each attempt is cut (the server sees the disconnect and cancels it) and the next
    # resumes where it stopped; without that every attempt starts over and none finishes.
    import time

    import openai

    from mlxmtp.engine.prefill import Prefiller

    forward = Prefiller._forward

    def slow(self, row, tokens, logits_needed):
        time.sleep(0.15)  # a large model's chunk
        return forward(self, row, tokens, logits_needed)

    server = start_server(engine=served_engine(prefix_cache_bytes=256 << 20, prefill_step=CHUNK))
    long = " ".join(f"word{i}" for i in range(40))
    body = dict(model="m", max_tokens=8, temperature=0, messages=[{"role": "user", "content": long}])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=1.2, max_retries=6)
    monkeypatch.setattr(Prefiller, "_forward", slow)
    resumed = client.chat.completions.create(**body)
    monkeypatch.setattr(Prefiller, "_forward", forward)
    assert resumed.usage.prompt_tokens > 8 * CHUNK  # it did take several attempts' time
    again = client.chat.completions.create(**body)  # now from the cache whole
    assert resumed.choices[0].message.content == again.choices[0].message.content
