"""The part of a chat prompt other conversations share (server/shared_prefix.py): the
request's `shared_prefix`, where prefill stores a state (engine/prefill.py), so the second
conversation on one system prompt and tool set, not only the third, starts from it, with
the output a full prefill gives."""

import httpx
import pytest
from engine_helpers import loaded, prompt_of, reference_greedy
from server_helpers import served_engine

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.request import Request
from mlxmtp.server.chat import build_prompt
from mlxmtp.server.shared_prefix import shared_prefix

SYSTEM = {"role": "system", "content": "You review Python code for a careful team. " * 30}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


def test_the_shared_part_ends_where_the_conversations_differ(server_model):
    _, tok = server_model
    a = build_prompt(tok, [SYSTEM, {"role": "user", "content": "Is this loop right?"}], TOOLS)
    b = build_prompt(tok, [SYSTEM, {"role": "user", "content": "Rename the class."}], TOOLS)
    assert a.shared == b.shared > 300  # the system prompt and the tools
    assert a.ids[: a.shared] == b.ids[: b.shared] and a.ids[a.shared] != b.ids[b.shared]
    text = tok.decode(a.ids[: a.shared])
    assert text.count("careful team") == 30 and "read_file" in text and "Is this" not in text
    no_tools = build_prompt(tok, [SYSTEM, {"role": "user", "content": "Is this loop right?"}])
    assert 0 < no_tools.shared < a.shared
    assert build_prompt(tok, [{"role": "user", "content": "hi"}]).shared == 0  # nothing to share
    # A template that fails on the comparison render gives no hint, not an error.
    broken = type("T", (), {"chat_template": "x", "apply_chat_template": lambda *a, **k: 1 / 0})()
    assert shared_prefix(broken, [SYSTEM], None, {}, a.ids) == 0


@pytest.mark.parametrize("mtp", [True, False])
def test_the_second_conversation_starts_from_the_first_ones_shared_state(fixture_model, mtp):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    eng = BatchGenerator(model, tok, EngineConfig(enable_mtp=mtp, num_draft=2 if mtp else None,
                                                  prefix_cache_bytes=256 << 20, prefill_step=64))
    system = prompt_of(200, seed=11)
    prompts = [system + prompt_of(9, seed=12), system + prompt_of(5, seed=13)]
    cached = []
    for prompt in prompts:
        eng.submit(Request(prompt=prompt, max_tokens=10, shared_prefix=len(system)))
        out, last = [], None
        while eng.has_work:
            for ev in eng.step():
                out, last = out + ev.token_ids, ev
        assert out == reference_greedy(ref, prompt, 10)
        cached.append(last.stats.cached_prompt_tokens)
    assert cached == [0, len(system)]
    assert eng.prefix_cache.entries[tuple(system)].boundary  # kept on disk when evicted


def test_a_hint_shorter_than_a_chunk_stores_nothing(fixture_model):
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    eng = BatchGenerator(model, tok, EngineConfig(prefix_cache_bytes=256 << 20, prefill_step=64))
    system = prompt_of(40, seed=14)  # cheaper to prefill again than to keep
    eng.submit(Request(prompt=system + prompt_of(30, seed=15), max_tokens=2, shared_prefix=len(system)))
    while eng.has_work:
        eng.step()
    assert tuple(system) not in eng.prefix_cache.entries


@pytest.mark.slow
@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_a_server_reads_the_system_prompt_of_the_second_conversation_from_the_cache(start_server, api):
    cached_server = start_server(engine=served_engine(prefix_cache_bytes=64 << 20, prefill_step=64))
    plain_server = start_server(engine=served_engine(prefix_cache_bytes=0))
    answers = {}
    for srv in (cached_server, plain_server):
        for text in ("Is this loop right?", "Rename the class."):
            if api == "openai":
                body = {"model": "m", "max_tokens": 6, "temperature": 0, "tools": TOOLS,
                        "messages": [SYSTEM, {"role": "user", "content": text}]}
                r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
                answers.setdefault(srv.url, []).append((r["choices"][0]["message"]["content"],
                                                        r["usage"]["prompt_tokens_details"]["cached_tokens"]))
            else:
                body = {"model": "m", "max_tokens": 6, "temperature": 0, "system": SYSTEM["content"],
                        "tools": [{"name": "read_file", "description": "Read a file.",
                                   "input_schema": TOOLS[0]["function"]["parameters"]}],
                        "messages": [{"role": "user", "content": text}]}
                r = httpx.post(srv.url + "/v1/messages", json=body, timeout=60).json()
                answers.setdefault(srv.url, []).append((r["content"], r["usage"]["cache_read_input_tokens"]))
    with_cache, without = answers[cached_server.url], answers[plain_server.url]
    assert [a for a, _ in with_cache] == [a for a, _ in without]
    assert with_cache[0][1] == 0 and with_cache[1][1] > 300 and [c for _, c in without] == [0, 0]


def test_a_system_prompts_state_is_written_and_restored_after_a_restart(fixture_model, tmp_path):
    """One conversation on a system prompt, then a restart: its checkpoint where the system
    prompt ends goes to disk with the conversation's end (though no other conversation
    went on from it yet), and the next session starts from it."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))

    def engine():
        return BatchGenerator(model, tok, EngineConfig(prefix_cache_bytes=256 << 20, prefill_step=64,
                                                       prefix_cache_dir=str(tmp_path), prefix_cache_disk_mb=64))

    system = prompt_of(200, seed=16)
    first = engine()
    first.submit(Request(prompt=system + prompt_of(9, seed=17), max_tokens=6, shared_prefix=len(system)))
    while first.has_work:
        first.step()
    first.prefix_cache.save_to_disk()
    assert tuple(system) in first.prefix_cache.disk.entries
    again = engine()
    prompt = system + prompt_of(7, seed=18)
    again.submit(Request(prompt=prompt, max_tokens=6, shared_prefix=len(system)))
    out, last = [], None
    while again.has_work:
        for ev in again.step():
            out, last = out + ev.token_ids, ev
    assert out == reference_greedy(ref, prompt, 6) and last.stats.cached_prompt_tokens == len(system)
