"""End-to-end: a real uvicorn server on 127.0.0.1 with the fixture model and the real
engine, driven by the official `openai` and `anthropic` clients (and raw httpx where
the clients would hide what is under test).

The fixture model is random, so its text is gibberish and it never emits special
tokens. Tool-call / thinking tests force its output with a test-only logits processor
(server_helpers.Hook): the engine, HTTP layer, SSE assembly and parsers all run for real,
only the token choice is scripted.
"""

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import Hook, ServerThread, served_engine, streams_solo_and_together

from mlxmtp.server.app import create_app
from mlxmtp.server.config import ServerConfig

MODEL = "fixture"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather for a city.",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]


SCRIPTS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    "xml": ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    "think": "<think>\nThe user wants a greeting.\n</think>\n\nHello there!",
    "thinktool": ('<think>\nneed weather\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                  '"arguments": {"city": "Oslo"}}\n</tool_call>'),
    "indent": "    return x ",
    "twocalls": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(SCRIPTS, model_id=MODEL, max_prompt_tokens=1500, engine=served_engine(max_batch=8))


def chat(oai, text, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], **kw)


def wait_idle(state, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if state.bridge.num_open == 0 and state.bridge.num_active == 0 and state.bridge.num_waiting == 0:
            return True
        time.sleep(0.02)
    return False


# ------------------------------------------------------------------ basics
def test_models_and_health(server, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL
    assert oai.models.retrieve("other").id == "other"  # any name is served (see test_strict_model_name)
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["mtp_active"] is True


def test_chat_nonstream_usage_and_mtp(oai):
    r = chat(oai, "Hello", max_tokens=16)
    assert r.object == "chat.completion" and r.model == MODEL
    c = r.choices[0]
    assert c.finish_reason == "length" and isinstance(c.message.content, str) and c.message.content
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 16
    mtp = r.usage.model_extra["mtp"]
    assert set(mtp) >= {"drafted", "accepted", "acceptance", "tokens_per_forward"}
    # The adaptive policy may settle on depth 0 for the random model: counts, not values.
    assert mtp["drafted"] >= mtp["accepted"] >= 0 and 0 <= mtp["acceptance"] <= 1


def test_chat_stream_matches_nonstream_and_reports_usage(oai):
    ref = chat(oai, "Stream me", max_tokens=20).choices[0].message.content
    stream = chat(oai, "Stream me", max_tokens=20, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert "mtp" in chunks[-1].usage.model_extra


def test_raw_sse_format(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_completions_stream_and_not(oai):
    r = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    s = list(oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0,
                                    stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text
    assert s[-1].usage.completion_tokens == 10
    ids = oai.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_text_is_the_tokens_exactly_first_space_included(oai):
    # A completion's first token is often a space (`x =` -> ` 0`) and a code answer's first
    # line may be indented: neither API drops those spaces, nor a trailing one.
    c = oai.completions.create(model=MODEL, prompt="FORCE:indent", max_tokens=20, temperature=0)
    assert c.choices[0].text == SCRIPTS["indent"]
    s = oai.completions.create(model=MODEL, prompt="FORCE:indent", max_tokens=20, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in s if ch.choices) == SCRIPTS["indent"]
    assert chat(oai, "FORCE:indent", max_tokens=20).choices[0].message.content == SCRIPTS["indent"]


def test_logprobs(oai):
    r = chat(oai, "Hello", max_tokens=8, logprobs=True, top_logprobs=0)
    lps = r.choices[0].logprobs.content
    assert len(lps) == 8 and all(e.logprob <= 0 and e.top_logprobs == [] for e in lps)
    assert "".join(e.token for e in lps) == r.choices[0].message.content
    s = list(chat(oai, "Hello", max_tokens=8, logprobs=True, stream=True))
    streamed = [e.logprob for c in s if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in lps], abs=1e-4)
    c = oai.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0, logprobs=0)
    assert len(c.choices[0].logprobs.token_logprobs) == 5


def test_logprobs_carry_each_token_s_own_bytes_and_offsets(oai, server):
    # A byte-level token can be half a UTF-8 character: its text alone is U+FFFD, its bytes
    # are its own, and the bytes joined are the text. "é" is two such tokens here.
    tok = server.hook.tok
    half = tok.encode("é", add_special_tokens=False)[0]
    r = chat(oai, "Hello", max_tokens=3, logprobs=True, top_logprobs=1, logit_bias={str(half): 100})
    lps = r.choices[0].logprobs.content
    assert lps[0].bytes == list("é".encode())[:1] and lps[0].token == "\ufffd"
    assert b"".join(bytes(e.bytes) for e in lps).decode("utf-8", "replace") == r.choices[0].message.content
    # Completions: the sampled token is among its top_logprobs; a stream's text_offset runs on.
    kw = dict(model=MODEL, prompt="def f(", max_tokens=8, temperature=1.5, seed=3, logprobs=1,
              extra_body={"num_draft": 0})
    whole = oai.completions.create(**kw).choices[0].logprobs
    assert all(t in top for t, top in zip(whole.tokens, whole.top_logprobs))
    chunks = [c.choices[0].logprobs for c in oai.completions.create(**kw, stream=True) if c.choices[0].logprobs]
    assert [o for lp in chunks for o in lp.text_offset] == whole.text_offset
    assert whole.text_offset == [sum(len(t) for t in whole.tokens[:i]) for i in range(8)]


def test_sampling_params_and_seed(oai):
    # Same seed, same output, whatever depth the request is drafted at (engine/sampling/seeded.py):
    # MTP off, pinned depths and the adaptive policy's own choice.
    kw = dict(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.5, frequency_penalty=0.2)
    opts = {"top_k": 50, "min_p": 0.05, "repetition_penalty": 1.1}
    texts = [chat(oai, "sample", **kw, extra_body={**opts, **depth}).choices[0].message.content
             for depth in ({"num_draft": 0}, {"num_draft": 3}, {"num_draft": 1}, {})]
    assert len(set(texts)) == 1, texts
    other = chat(oai, "sample", **{**kw, "seed": 8}, extra_body=opts).choices[0].message.content
    assert other != texts[0]
    completions = [oai.completions.create(model=MODEL, prompt="def f(", max_tokens=10, temperature=1.0, seed=5,
                                          extra_body=depth).choices[0].text for depth in ({"num_draft": 0}, {})]
    assert completions[0] == completions[1]
    r = chat(oai, "sample", max_completion_tokens=3)
    assert r.usage.completion_tokens == 3


def test_stop_sequences(oai, ant):
    ref = chat(oai, "stop test", max_tokens=24).choices[0].message.content
    stop = ref[8:11]
    assert stop.strip()
    cut = ref[: ref.find(stop)]
    r = chat(oai, "stop test", max_tokens=24, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == cut.strip()
    base = ant.messages.create(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "stop test"}])
    full = base.content[0].text
    stop2 = full[8:11]
    m = ant.messages.create(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "stop test"}],
                            stop_sequences=[stop2])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop2
    assert m.content[0].text == full[: full.find(stop2)].strip()


# ------------------------------------------------------------------ Anthropic
def test_anthropic_messages_nonstream_and_stream(ant):
    kw = dict(model=MODEL, max_tokens=16, extra_body={"temperature": 0, "top_k": 0}, system=[{"type": "text", "text": "Be terse."}],
              messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    m = ant.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    assert m.content[0].type == "text" and m.usage.output_tokens == 16 and m.usage.input_tokens > 5
    assert m.usage.model_extra["mtp"]["drafted"] >= m.usage.model_extra["mtp"]["accepted"] >= 0
    with ant.messages.stream(**kw) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == "max_tokens"
    assert events[0] == "message_start" and "content_block_delta" in events and events[-1] == "message_stop"
    n = ant.messages.count_tokens(model=MODEL, system=kw["system"], messages=kw["messages"])
    assert n.input_tokens == m.usage.input_tokens


def test_anthropic_raw_events(server):
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=30) as r:
        names = [ln[7:] for ln in r.iter_lines() if ln.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


# ------------------------------------------------------------------ tools and thinking (forced output)
def test_tool_call_hermes_openai(oai):
    r = chat(oai, "FORCE:hermes weather?", tools=TOOLS, max_tokens=400)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    call = c.message.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    # Forced tokens are exactly what the head drafts too? No: but every draft is verified.
    assert r.usage.model_extra["mtp"]["drafted"] >= 0


def test_tool_call_xml_openai_stream(oai):
    chunks = list(chat(oai, "FORCE:xml weather?", tools=TOOLS, max_tokens=400, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert content == "Let me check."
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
    args = "".join(tc.function.arguments or "" for tc in calls)
    assert json.loads(args) == {"city": "Paris", "days": 3}  # typed by the tool's schema
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
def test_one_tool_call_when_parallel_calls_are_off(server, oai, ant):
    # The model writes two calls; parallel_tool_calls false (OpenAI, Responses) or
    # disable_parallel_tool_use (Anthropic) ends the answer after the first.
    def chat_calls(**kw):
        r = chat(oai, "FORCE:twocalls", max_tokens=200, tools=TOOLS, **kw).choices[0]
        return r.finish_reason, [json.loads(c.function.arguments)["city"] for c in r.message.tool_calls]

    assert chat_calls() == ("tool_calls", ["Paris", "Oslo"])
    assert chat_calls(parallel_tool_calls=False) == ("tool_calls", ["Paris"])
    resp = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "model": MODEL, "input": "FORCE:twocalls", "max_output_tokens": 200, "parallel_tool_calls": False,
        "tools": [dict(type="function", **TOOLS[0]["function"])]}).json()
    assert [json.loads(i["arguments"])["city"] for i in resp["output"]] == ["Paris"]
    for disable, cities in ((False, ["Paris", "Oslo"]), (True, ["Paris"])):
        m = ant.messages.create(model=MODEL, max_tokens=200, tools=ANTHROPIC_TOOLS, messages=[
            {"role": "user", "content": "FORCE:twocalls"}],
            tool_choice={"type": "auto", "disable_parallel_tool_use": disable})
        assert m.stop_reason == "tool_use" and m.stop_sequence is None
        assert [b.input["city"] for b in m.content if b.type == "tool_use"] == cities


def test_tool_call_text_without_tools_is_content(oai):
    r = chat(oai, "FORCE:hermes weather?", max_tokens=400)
    assert r.choices[0].finish_reason == "stop" and "<tool_call>" in r.choices[0].message.content


def test_thinking_openai(oai):
    r = chat(oai, "FORCE:think hi", max_tokens=400)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "The user wants a greeting."
    assert m.content == "Hello there!" and r.choices[0].finish_reason == "stop"
    chunks = list(chat(oai, "FORCE:think hi", max_tokens=400, stream=True))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning == "The user wants a greeting." and content == "Hello there!"


def test_thinking_and_tool_use_anthropic(ant):
    kw = dict(model=MODEL, max_tokens=400, tools=ANTHROPIC_TOOLS, thinking={"type": "enabled", "budget_tokens": 50},
              messages=[{"role": "user", "content": "FORCE:thinktool weather in Oslo?"}])
    m = ant.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    assert m.content[0].thinking == "need weather"
    assert m.content[1].name == "get_weather" and m.content[1].input == {"city": "Oslo"}
    assert m.content[1].id.startswith("toolu_") and m.stop_reason == "tool_use"
    with ant.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[1].input == {"city": "Oslo"} and final.stop_reason == "tool_use"
    t = ant.messages.create(model=MODEL, max_tokens=400, messages=[{"role": "user", "content": "FORCE:think"}])
    assert [b.type for b in t.content] == ["thinking", "text"] and t.content[1].text == "Hello there!"


def test_enable_thinking_reaches_the_template(oai, ant):
    # The fixture template pre-fills an empty think block when enable_thinking is false.
    on = chat(oai, "t", max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    off = chat(oai, "t", max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    top = chat(oai, "t", max_tokens=1, extra_body={"enable_thinking": False})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens and top.usage.prompt_tokens == off.usage.prompt_tokens
    a_on = ant.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "t"}],
                               thinking={"type": "enabled", "budget_tokens": 10})
    a_off = ant.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "t"}],
                                thinking={"type": "disabled"})
    assert a_off.usage.input_tokens == off.usage.prompt_tokens and a_on.usage.input_tokens == on.usage.prompt_tokens


def test_tool_results_round_trip(oai, ant):
    r = oai.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, tools=TOOLS, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    m = ant.messages.create(model=MODEL, max_tokens=4, tools=ANTHROPIC_TOOLS, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "P"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}])
    # Same conversation through both APIs renders the same prompt.
    assert r.usage.prompt_tokens == m.usage.input_tokens > 40


# ------------------------------------------------------------------ concurrency, disconnects, failures
@pytest.mark.slow
def test_eight_concurrent_streams_equal_solo(server):
    prompts = [f"Request number {i}: " + "word " * i for i in range(8)]
    solo, together = streams_solo_and_together(server.url, MODEL, prompts, 24)
    assert together == solo
    assert wait_idle(server.state)


def _generated_total(server) -> float:
    fams = text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
    return next(s.value for f in fams for s in f.samples if s.name == "mlxmtp_generated_tokens_total")


def test_client_disconnect_mid_stream_frees_slot(server, oai):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 100000, "stream": True}
    before = _generated_total(server)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        it = r.iter_lines()
        got = [next(it) for _ in range(6)]
        assert server.state.bridge.num_active + server.state.bridge.num_waiting == 1
    assert any(ln.startswith("data: ") for ln in got)
    assert wait_idle(server.state), "the cancelled request still holds its slot"
    # What it generated before its client left is counted (its tokens took the machine's time).
    assert _generated_total(server) - before >= 4
    body["stream"] = False
    body["max_tokens"] = 100000
    # Non-streaming too: a client timing out cancels the request.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1.0)
    assert wait_idle(server.state)
    assert chat(oai, "still alive", max_tokens=3).usage.completion_tokens == 3


def test_engine_error_fails_only_that_request(server, oai, ant):
    restarts = server.state.bridge.restarts
    results = {}

    def bystander():
        # Sent alongside the bad request: the failure is the bad request's own (its logits
        # processor raised), so the bystander completes and the engine is not rebuilt.
        results["ok"] = chat(oai, "bystander", max_tokens=5).usage.completion_tokens

    with pytest.raises(openai.InternalServerError) as e:
        t = threading.Thread(target=bystander)
        t.start()
        chat(oai, "FAIL:now", max_tokens=5)
    t.join(30)
    assert "injected failure" in str(e.value)
    assert server.state.bridge.restarts == restarts
    with pytest.raises(anthropic.InternalServerError):
        ant.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "FAIL:now"}])
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "FAIL:now"}], "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert any('"error"' in ln for ln in lines) and lines[-1] == "data: [DONE]"
    assert chat(oai, "after", max_tokens=4).usage.completion_tokens == 4
    assert results["ok"] == 5
    assert server.state.bridge.restarts == restarts
    assert wait_idle(server.state)


# ------------------------------------------------------------------ bad input
OPENAI_BAD = [
    (b"{not json", 400),
    (b"[1, 2]", 400),
    ({"messages": [{"role": "user", "content": "x"}]}, 400),  # no model
    ({"model": MODEL}, 400),
    ({"model": MODEL, "messages": []}, 400),
    ({"model": MODEL, "messages": "hi"}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -0.5}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_k": 100000}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": 5}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": ""}}]}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": "abc"}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x " * 2000}]}, 400),
]


@pytest.mark.parametrize("body,status", OPENAI_BAD)
def test_openai_bad_input(server, body, status):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + "/v1/chat/completions", headers={"content-type": "application/json"}, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


ANTHROPIC_BAD = [
    (b"{", 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, 400),  # max_tokens required
    ({"model": MODEL, "max_tokens": 5, "messages": []}, 400),
    ({"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, 400),
    ({"model": MODEL, "max_tokens": 5, "temperature": -1, "messages": [{"role": "user", "content": "x"}]}, 400),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400),
    ({"model": MODEL, "max_tokens": 5, "thinking": {"type": "maybe"}, "messages": [{"role": "user", "content": "x"}]},
     400),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x " * 2000}]}, 400),
    # a text that is not a string would reach the prompt as its Python spelling ("None", "5")
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     400),
    ({"model": MODEL, "max_tokens": 5, "system": [{"type": "text", "text": 5}],
      "messages": [{"role": "user", "content": "x"}]}, 400),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": {}}]}]}, 400),
    ({"model": MODEL, "max_tokens": 5, "metadata": "m", "messages": [{"role": "user", "content": "x"}]}, 400),
    ({"model": MODEL, "max_tokens": 5, "tools": [{"name": "t", "description": 5, "input_schema": {"type": "object"}}],
      "messages": [{"role": "user", "content": "x"}]}, 400),
]


@pytest.mark.parametrize("body,status", ANTHROPIC_BAD)
def test_anthropic_bad_input(server, body, status):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + "/v1/messages", timeout=30, **kw)
    assert r.status_code == status, r.text
    j = r.json()
    assert j["type"] == "error" and j["error"]["type"] and j["error"]["message"]


def test_clients_raise_typed_errors_and_server_keeps_serving(oai, ant, server):
    with pytest.raises(openai.BadRequestError):
        chat(oai, "x", temperature=-1)
    with pytest.raises(anthropic.BadRequestError):
        ant.messages.create(model=MODEL, max_tokens=5, messages=[])
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    assert chat(oai, "fine", max_tokens=2).usage.completion_tokens == 2


def test_strict_model_name(server_model):
    """--strict-model-name: only the model id and its aliases; others get a typed 404 on
    every endpoint."""
    model, tok = server_model
    app = create_app(model, tok, ServerConfig(model_id=MODEL, aliases=("my-alias",), strict_model_name=True))
    user = [{"role": "user", "content": "x"}]
    with ServerThread(app) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        ant = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.NotFoundError):
            oai.chat.completions.create(model="gpt-99", messages=user)
        with pytest.raises(openai.NotFoundError):
            oai.completions.create(model="gpt-99", prompt="x")
        with pytest.raises(openai.NotFoundError):
            oai.responses.create(model="gpt-99", input="x")
        with pytest.raises(openai.NotFoundError):
            oai.models.retrieve("gpt-99")
        with pytest.raises(anthropic.NotFoundError):
            ant.messages.create(model="claude-x", max_tokens=5, messages=user)
        with pytest.raises(anthropic.NotFoundError):
            ant.messages.count_tokens(model="claude-x", messages=user)
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "nope", "messages": user}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = httpx.post(srv.url + "/v1/messages", json={"model": "nope", "max_tokens": 5, "messages": user})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert [m.id for m in oai.models.list().data] == [MODEL, "my-alias"]
        # An alias is answered, under its own name.
        assert oai.chat.completions.create(model="my-alias", messages=user, max_tokens=1).model == "my-alias"


# ------------------------------------------------------------------ metrics and auth
def test_metrics_parse(server, oai):
    chat(oai, "metrics", max_tokens=8)
    text = httpx.get(server.url + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("mlxmtp_requests", "mlxmtp_prompt_tokens", "mlxmtp_generated_tokens",
                 "mlxmtp_time_to_first_token_seconds", "mlxmtp_inter_token_latency_seconds", "mlxmtp_queue_length",
                 "mlxmtp_batch_size", "mlxmtp_mtp_drafted_tokens", "mlxmtp_mtp_accepted_tokens",
                 "mlxmtp_mtp_acceptance_by_position", "mlxmtp_mtp_depth_cycles"):
        assert name in fams, name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    assert samples[("mlxmtp_generated_tokens_total", ())] >= 8
    assert samples[("mlxmtp_mtp_drafted_tokens_total", ())] >= samples[("mlxmtp_mtp_accepted_tokens_total", ())]
    assert samples[("mlxmtp_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))] >= 1


def test_metrics_show_the_prefix_cache(start_server):
    srv = start_server(model_id=MODEL, engine=served_engine(prefix_cache_bytes=64 << 20))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    first = chat(client, "the same long question " * 20, max_tokens=4)
    chat(client, "the same long question " * 20, max_tokens=4)
    text = httpx.get(srv.url + "/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("mlxmtp_prefix_cache_entries", ())] >= 1
    assert 0 < samples[("mlxmtp_prefix_cache_bytes", ())] <= 64 << 20
    assert samples[("mlxmtp_prefix_cache_lookups", (("result", "hit"),))] >= 1
    assert samples[("mlxmtp_prefix_cache_lookups", (("result", "miss"),))] >= 1
    # The second request's whole prompt was restored: all of it but nothing prefilled.
    assert samples[("mlxmtp_cached_prompt_tokens_total", ())] == first.usage.prompt_tokens


def test_finished_rows_are_stored_from_the_engine_thread(start_server):
    """A row that finishes in a cycle read synchronously (here: its logits processor forces
    a script, then EOS) is stored in the prefix cache then, on the engine's thread (MLX
    streams are per thread: an array made on another thread cannot be evaluated there)."""
    srv = start_server(SCRIPTS, model_id=MODEL, engine=served_engine(prefix_cache_bytes=64 << 20))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    for text in ("a first question FORCE:think", "a second one FORCE:think"):
        assert chat(client, text, max_tokens=40).choices[0].finish_reason == "stop"
    text = httpx.get(srv.url + "/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples.get(("mlxmtp_engine_errors_total", ()), 0) == 0
    assert samples[("mlxmtp_prefix_cache_entries", ())] == 4  # each prompt, each finished request


def test_api_key(server_model):
    model, tok = server_model
    # Also the fixed-depth server option: every decode cycle drafts 2 tokens.
    app = create_app(model, tok, ServerConfig(model_id=MODEL, api_key="sekret"), served_engine(num_draft=2))
    with ServerThread(app) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.get(srv.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(srv.url + "/v1/messages", json={})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(srv.url + "/metrics").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)  # Bearer
        usage = good.chat.completions.create(model=MODEL, max_tokens=12, messages=[
            {"role": "user", "content": "x"}]).usage
        mtp = usage.model_extra["mtp"]
        assert usage.completion_tokens == 12 and mtp["drafted"] > 0 and mtp["depths"].get("2", 0) > 0
        assert mtp["tokens_per_forward"] >= 1.0
        m = anthropic.Anthropic(base_url=srv.url, api_key="sekret", max_retries=0).messages.create(  # x-api-key
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
        assert m.usage.output_tokens == 2
        assert httpx.get(srv.url + "/metrics", headers={"x-api-key": "sekret"}).status_code == 200


def test_template_that_opens_think(tmp_path, server_model):
    """Qwen3.5/3.6 templates open `<think>` in the generation prompt when thinking is on:
    the output then starts inside the reasoning (no `<think>` of its own)."""
    from mlx_lm.tokenizer_utils import load as load_tok

    from mlxmtp.testing.fixtures import CHAT_TEMPLATE, write_tokenizer

    model, _ = server_model
    write_tokenizer(tmp_path)
    tok = load_tok(tmp_path)
    tok._tokenizer.chat_template = CHAT_TEMPLATE.replace(
        "{%- if enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}",
        "{%- if enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}"
        "\n    {%- else %}\n        {{- '<think>\\n' }}")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                   tokenize=False, enable_thinking=True).endswith("<think>\n")
    hook = Hook(tok)
    hook.scripts["open"] = "I should greet.\n</think>\n\nHi!"
    app = create_app(model, tok, ServerConfig(model_id=MODEL), request_hook=hook)
    with ServerThread(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        r = chat(client, "FORCE:open", max_tokens=400, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert r.choices[0].message.model_extra["reasoning_content"] == "I should greet."
        assert r.choices[0].message.content == "Hi!"
        m = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0).messages.create(
            model=MODEL, max_tokens=400, thinking={"type": "enabled", "budget_tokens": 100},
            messages=[{"role": "user", "content": "FORCE:open"}])
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == \
            [("thinking", "I should greet."), ("text", "Hi!")]
        # Cut off by max_tokens while thinking: it is all reasoning, none leaks into content.
        r = chat(client, "FORCE:open", max_tokens=3, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert r.choices[0].finish_reason == "length" and not r.choices[0].message.content
        assert r.choices[0].message.model_extra["reasoning_content"]


@pytest.mark.slow
@pytest.mark.parametrize("option", ["pipeline_drafts", "compile_steps"])
def test_experimental_cycles_serve_the_same_greedy_output(start_server, oai, option):
    """`serve --pipeline-drafts` / `--compile-steps`: streamed and collected answers equal the
    default engine's."""
    import openai

    srv = start_server(model_id=MODEL, engine=served_engine(**{option: True}))
    piped = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    pin = {"num_draft": 3}  # adaptive depth may stay at plain decoding on the fixture
    for text in ("def add(a, b):", "Write a loop"):
        want = chat(oai, text, max_tokens=40).choices[0].message.content
        assert chat(piped, text, max_tokens=40, extra_body=pin).choices[0].message.content == want
        stream = chat(piped, text, max_tokens=40, stream=True, extra_body=pin)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


@pytest.mark.slow
def test_cycle_costs_are_calibrated_before_the_first_request(server_model, monkeypatch):
    """The server measures decode-cycle costs while starting, so no request waits for it."""
    from engine_helpers import calibration_calls

    from mlxmtp.models.mtp_model import MTPModel

    base, tok = server_model
    model = MTPModel(base.base, base.parts, base.head, base.source, base.info, base.hidden_state,
                     vocab=base.vocab)  # the same weights, policies of its own
    kinds = []
    calls = calibration_calls(monkeypatch, kinds)
    with ServerThread(create_app(model, tok, ServerConfig(model_id=MODEL))) as srv:
        assert calls == [1] and kinds == [("greedy", "sampled")]  # before any request, both kinds
        policy = srv.state.bridge.engine.policy
        assert not policy.needs_costs(1)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        chat(client, "def f(x):", max_tokens=8)
        assert calls == [1]
