"""POST /v1/responses end to end: a real uvicorn server with the fixture model, driven by
the official `openai` SDK (`responses.create`, `responses.stream`) and raw httpx where the
SDK would hide what is under test (headers, event names, error params).

Tool calls and thinking are forced through the test hook (server_helpers.Hook), as in
test_server.py: the engine, SSE assembly and parsers run for real.
"""

import json
import time

import httpx
import openai
import pytest
from server_helpers import served_engine

MODEL = "fixture"
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city.", "parameters": PARAMS}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                                "parameters": PARAMS}}]
MSG = {"type": "object", "properties": {"message": {"type": "string"}}}
NAMESPACE_TOOLS = [
    {"type": "namespace", "name": "collaboration", "description": "Work with other agents.",
     "tools": [{"type": "function", "name": "spawn_agent", "description": "Spawns an agent.", "parameters": MSG}]},
    {"type": "namespace", "name": "mcp__files__", "description": "A file server.",
     "tools": [{"type": "function", "name": "read", "parameters": {"type": "object", "properties": {
         "path": {"type": "string"}}}}]},
    {"type": "web_search"},
    TOOLS[0],
]


SCRIPTS = {
    "hello": "Hello there, friend!",
    "call": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    "textcall": ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                 "</function>\n</tool_call>"),
    "think": "<think>\nThe user wants a greeting.\n</think>\n\nHello there!",
    "spawn": '<tool_call>\n{"name": "spawn_agent", "arguments": {"message": "go"}}\n</tool_call>',
    "mcpread": '<tool_call>\n{"name": "mcp__files__read", "arguments": {"path": "a.txt"}}\n</tool_call>',
}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(SCRIPTS, model_id=MODEL, max_prompt_tokens=1500, aliases=["gpt-5-codex"],
                        engine=served_engine(max_batch=4))


def create(oai, input, **kw):
    kw.setdefault("max_output_tokens", 12)
    kw.setdefault("temperature", 0)
    return oai.responses.create(model=MODEL, input=input, **kw)


def raw_events(server, body):
    """(event name, data) pairs of a streamed response, checking the SSE framing."""
    with httpx.stream("POST", server.url + "/v1/responses", json={"model": MODEL, "stream": True, **body},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = []
    for block in text.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        data = json.loads(data_line[6:])
        assert data["type"] == name_line[7:]
        events.append((data["type"], data))
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    return events


def wait_idle(state, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if state.bridge.num_open == 0 and state.bridge.num_active == 0 and state.bridge.num_waiting == 0:
            return True
        time.sleep(0.02)
    return False


# ------------------------------------------------------------------ probes
def test_root_answers_get_and_head(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["model"] == MODEL
    assert httpx.head(server.url + "/").status_code == 200


# ------------------------------------------------------------------ text
def test_create_nonstream_and_stream_agree(server, oai):
    r = create(oai, "Hello", instructions="Be terse.")
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output[0].content[0].type == "output_text" and r.output_text
    u = r.usage
    assert u.output_tokens == 12 and u.input_tokens > 5 and u.total_tokens == u.input_tokens + 12
    assert u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens == 0
    assert u.model_extra["mtp"]["drafted"] >= u.model_extra["mtp"]["accepted"] >= 0

    events = list(create(oai, "Hello", instructions="Be terse.", stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 12 and final.id == events[0].response.id
    # Answered under the name the client used (an alias here).
    assert oai.responses.create(model="gpt-5-codex", input="x", max_output_tokens=1).model == "gpt-5-codex"


def test_stream_helper_assembles_the_final_text(oai):
    deltas = []
    with oai.responses.stream(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "FORCE:hello"}]}], max_output_tokens=100) as s:
        for event in s:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = s.get_final_response()
    assert "".join(deltas) == final.output_text == "Hello there, friend!"
    assert final.status == "completed" and final.incomplete_details is None


# ------------------------------------------------------------------ tools
@pytest.mark.slow
def test_tool_call_round_trip(server, oai):
    r = create(oai, "FORCE:call weather?", tools=TOOLS, max_output_tokens=200, parallel_tool_calls=True,
               tool_choice="auto", store=False, include=["reasoning.encrypted_content"])
    assert r.status == "completed" and [i.type for i in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}

    # Streamed: text then a call, each its own item; the SDK helper rebuilds both.
    with oai.responses.stream(model=MODEL, input="FORCE:textcall", tools=TOOLS, max_output_tokens=200) as s:
        types = [e.type for e in s]
        final = s.get_final_response()
    assert [i.type for i in final.output] == ["message", "function_call"]
    assert final.output[0].content[0].text == "Let me check."
    assert json.loads(final.output[1].arguments) == {"city": "Oslo"}
    assert types.index("response.function_call_arguments.delta") < types.index("response.function_call_arguments.done")

    # Second turn: the call and its output go back as input items (with a reasoning item
    # before the call); the prompt is the one chat completions renders.
    turn = [{"role": "user", "content": "weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [
                {"type": "reasoning_text", "text": "need the weather"}]},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    r2 = create(oai, turn, tools=TOOLS, instructions="Be brief.", max_output_tokens=4)
    assert r2.status == "incomplete" and r2.usage.output_tokens == 4
    c = oai.chat.completions.create(model=MODEL, max_tokens=1, tools=CHAT_TOOLS, messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "need the weather", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}])
    assert r2.usage.input_tokens == c.usage.prompt_tokens > 60


def test_a_session_recorded_elsewhere_resumes_here(oai):
    # A Codex session started against OpenAI carries items of tools that cannot run here
    # (freeform apply_patch, local_shell, hosted web_search) and a picture the user
    # attached: its later turns must still run. They render as the equivalent chat turns.
    patch = "*** Begin Patch\n*** End Patch"
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": "fix it"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "x"}},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": patch},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"},
        {"type": "local_shell_call", "call_id": "c2", "id": "lsh_1", "status": "completed",
         "action": {"type": "exec", "command": ["ls"]}},
        {"type": "local_shell_call_output", "id": "c2", "output": "a.py"}]
    r = create(oai, history, max_output_tokens=1)
    c = oai.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "user", "content": "fix it[input_image omitted: this server reads text only]"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "apply_patch", "arguments": json.dumps({"input": patch})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Done!"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c2", "type": "function", "function": {
            "name": "local_shell", "arguments": json.dumps({"type": "exec", "command": ["ls"]})}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "a.py"}])
    assert r.usage.input_tokens == c.usage.prompt_tokens > 60


def test_raw_tool_call_events(server):
    events = raw_events(server, {"input": "FORCE:call", "tools": TOOLS, "max_output_tokens": 200})
    names = [n for n, _ in events]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    added, done = events[2][1]["item"], events[5][1]["item"]
    assert added["arguments"] == "" and added["status"] == "in_progress" and added["id"] == done["id"]
    assert json.loads(done["arguments"]) == {"city": "Paris", "days": 2} and done["call_id"] == added["call_id"]
    assert events[-1][1]["response"]["output"] == [done]
    assert events[-1][1]["response"]["usage"]["mtp"]["drafted"] >= 0


@pytest.mark.slow
def test_namespace_and_hosted_tools_with_developer_input(oai):
    dev = [{"type": "message", "role": "developer", "content": "Use the tools."}]
    raw = oai.responses.with_raw_response.create(
        model=MODEL, input=dev + [{"role": "user", "content": "FORCE:spawn"}], tools=NAMESPACE_TOOLS,
        max_output_tokens=200)
    assert "web_search" in raw.headers["x-mlxmtp-warning"]
    # However many tools are left out, the header stays short enough for HTTP clients.
    many = httpx.post(oai.base_url.join("responses").__str__(), timeout=30, json={
        "model": MODEL, "input": "x", "max_output_tokens": 1, "tools": [{"type": "web_search"}] * 3000})
    assert many.status_code == 200 and many.headers["x-mlxmtp-warning"].endswith("more")
    assert 100 < len(many.headers["x-mlxmtp-warning"]) <= 2100
    r = raw.parse()
    call = r.output[0]
    assert (call.type, call.name, call.namespace) == ("function_call", "spawn_agent", "collaboration")
    assert json.loads(call.arguments) == {"message": "go"}
    r = create(oai, dev + [{"role": "user", "content": "FORCE:mcpread"}], tools=NAMESPACE_TOOLS,
               max_output_tokens=200)
    assert (r.output[0].name, r.output[0].namespace) == ("read", "mcp__files__")
    # The namespaced call goes back as input; a named tool_choice inside a namespace is fine.
    back = [{"role": "user", "content": "x"},
            {"type": "function_call", "call_id": "c1", "name": "read", "namespace": "mcp__files__",
             "arguments": '{"path": "a.txt"}'},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "hi"}]}]
    r = create(oai, dev + back, tools=NAMESPACE_TOOLS, max_output_tokens=2,
               tool_choice={"type": "function", "name": "spawn_agent"})
    assert r.usage.output_tokens == 2


# ------------------------------------------------------------------ reasoning
def test_reasoning_items(server, oai):
    r = create(oai, "FORCE:think", max_output_tokens=200, reasoning={"effort": "high", "summary": "auto"})
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].type == "reasoning_text"
    assert r.output[0].content[0].text == "The user wants a greeting."
    assert r.output_text == "Hello there!" and r.usage.output_tokens_details.reasoning_tokens > 0

    events = raw_events(server, {"input": "FORCE:think", "max_output_tokens": 200})
    names = [n for n, _ in events]
    assert names[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[2][1]["item"]["type"] == "reasoning"
    rs = [d["delta"] for n, d in events if n == "response.reasoning_text.delta"]
    assert "".join(rs) == "The user wants a greeting."
    assert names.index("response.reasoning_text.done") < names.index("response.output_text.delta")
    assert [d["item"]["type"] for n, d in events if n == "response.output_item.done"] == ["reasoning", "message"]
    assert names[-1] == "response.completed"

    # effort none/minimal turns thinking off (the fixture template then pre-fills an empty
    # think block: a longer prompt).
    on = create(oai, "t", max_output_tokens=1, reasoning={"effort": "low"})
    off = create(oai, "t", max_output_tokens=1, reasoning={"effort": "none"})
    assert off.usage.input_tokens > on.usage.input_tokens
    assert create(oai, "t", max_output_tokens=1, reasoning={"effort": "minimal"}).usage.input_tokens == \
        off.usage.input_tokens


# ------------------------------------------------------------------ errors
USER = {"role": "user", "content": "x"}
BAD = [
    ({}, 400, "model"),
    ({"model": MODEL}, 400, "input"),
    ({"model": MODEL, "input": []}, 400, "input"),
    ({"model": MODEL, "input": 5}, 400, "input"),
    ({"model": MODEL, "input": [5]}, 400, "input[0]"),
    ({"model": MODEL, "input": [{"type": "message", "role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ({"model": MODEL, "input": [{"role": "user"}]}, 400, "input[0].content"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_video", "video_url": "u"}]}]}, 400,
     "input[0].content[0].type"),
    ({"model": MODEL, "input": [USER, {"type": "custom_tool_call", "call_id": "c", "name": "apply_patch"}]}, 400,
     "input[1].input"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text"}]}]}, 400,
     "input[0].content[0].text"),
    ({"model": MODEL, "input": [USER, {"type": "function_call", "name": "f", "arguments": "{}"}]}, 400,
     "input[1].call_id"),
    ({"model": MODEL, "input": [USER, {"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
     400, "input[1].arguments"),
    ({"model": MODEL, "input": [USER, {"type": "function_call_output", "call_id": "c"}]}, 400, "input[1].output"),
    ({"model": MODEL, "input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type"),
    ({"model": MODEL, "input": [{"role": "system", "content": "only a system prompt"}]}, 400, "input"),
    ({"model": MODEL, "input": "x", "tools": {"type": "function"}}, 400, "tools"),
    ({"model": MODEL, "input": "x", "tools": [{"type": "function"}]}, 400, "tools[0].name"),
    ({"model": MODEL, "input": "x", "tools": [{"name": "f"}]}, 400, "tools[0].type"),
    ({"model": MODEL, "input": "x", "tools": [{"type": "namespace", "name": "ns"}]}, 400, "tools[0].tools"),
    ({"model": MODEL, "input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 400,
     "tool_choice.name"),
    ({"model": MODEL, "input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"model": MODEL, "input": "x", "tool_choice": "sometimes"}, 400, "tool_choice"),
    ({"model": MODEL, "input": "x", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"model": MODEL, "input": "x", "conversation": "conv_1"}, 400, "conversation"),
    ({"model": MODEL, "input": "x", "reasoning": {"effort": "max"}}, 400, "reasoning.effort"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"model": MODEL, "input": "x", "temperature": 3}, 400, "temperature"),
    ({"model": MODEL, "input": "x", "store": "no"}, 400, "store"),
    ({"model": MODEL, "input": "x", "prompt_cache_key": 5}, 400, "prompt_cache_key"),
    ({"model": MODEL, "input": "x", "top_logprobs": "x"}, 400, "top_logprobs"),
    ({"model": MODEL, "input": "x", "top_logprobs": 10**9}, 400, "top_logprobs"),  # chat's bound: 0..20
    ({"model": MODEL, "input": "x", "top_logprobs": 21}, 400, "top_logprobs"),
    ({"model": MODEL, "input": "x", "top_logprobs": -1}, 400, "top_logprobs"),
    ({"model": MODEL, "input": "x", "tools": [TOOLS[0], {"type": "made_up_tool"}]}, 400, "tools[1].type"),
    ({"model": MODEL, "input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": [
        {"type": "web_search"}]}]}, 400, "tools[0].tools[0].type"),
    ({"model": MODEL, "input": "x", "truncation": "middle"}, 400, "truncation"),
    ({"model": MODEL, "input": "x " * 2000}, 400, "input"),
    # NaN / Infinity (JavaScript's, read by Python's json) anywhere: no reply could echo them.
    ({"model": MODEL, "input": "x", "text": {"format": {"type": "text", "name": float("nan")}}}, 400,
     "text.format.name"),
    ({"model": MODEL, "input": "x", "metadata": {"k": float("inf")}}, 400, "metadata.k"),
    ({"model": MODEL, "input": "x", "metadata": {"k": json.loads("[" * 300 + "]" * 300)}}, 400, "metadata"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_requests_name_the_field(server, body, status, param):
    r = httpx.post(server.url + "/v1/responses", content=json.dumps(body, allow_nan=True),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if param == "previous_response_id":
        assert "no conversation state" in err["message"]


def test_known_tool_types_and_top_logprobs_in_range_are_accepted(server):
    # Hosted tools the Responses API defines are left out with a warning, not refused.
    hosted = [{"type": t} for t in ("web_search", "web_search_2025_08_26", "file_search", "code_interpreter",
                                    "mcp", "custom", "image_generation", "local_shell")]
    hosted.append({"type": "namespace", "name": "ns", "tools": [{"type": "custom", "name": "patch"}]})
    r = httpx.post(server.url + "/v1/responses", timeout=30, json={
        "model": MODEL, "input": "x", "max_output_tokens": 1, "tools": hosted, "top_logprobs": 20})
    assert r.status_code == 200, r.text
    warning = r.headers["x-mlxmtp-warning"]
    assert all(f"tools[{i}]" in warning for i in range(len(hosted) - 1)) and "tools[8].tools[0]" in warning
    err = httpx.post(server.url + "/v1/responses", timeout=30, json={
        "model": MODEL, "input": "x", "tools": [{"type": "made_up_tool"}]}).json()["error"]
    assert "made_up_tool" in err["message"] and "web_search" in err["message"]


def test_sdk_raises_typed_errors(oai):
    with pytest.raises(openai.BadRequestError, match="not in 'tools'"):
        create(oai, "x", tools=TOOLS, tool_choice={"type": "function", "name": "missing"})
    with pytest.raises(openai.BadRequestError, match="no conversation state"):
        create(oai, "x", previous_response_id="resp_abc")
    # Any model name is answered (the 404 of --strict-model-name: test_server.py).
    assert oai.responses.create(model="gpt-99", input="x", max_output_tokens=1).model == "gpt-99"


def test_engine_error_and_disconnect(server, oai):
    with pytest.raises(openai.InternalServerError, match="injected failure"):
        create(oai, "FAIL:now")
    events = raw_events(server, {"input": "FAIL:now"})
    assert [n for n, _ in events][-2:] == ["error", "response.failed"]
    assert "injected failure" in events[-2][1]["message"]
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and "injected failure" in failed["error"]["message"]
    # A client that leaves mid-stream frees its slot.
    body = {"model": MODEL, "input": "long", "max_output_tokens": 100000, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=30) as r:
        it = r.iter_lines()
        for _ in range(12):
            next(it)
    assert wait_idle(server.state), "the cancelled request still holds its slot"
    assert create(oai, "still alive", max_output_tokens=3).usage.output_tokens == 3
