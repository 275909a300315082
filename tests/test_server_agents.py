"""Request bodies shaped like the coding agents' own, replayed against a real server.

Claude Code speaks /v1/messages?beta=true: a system prompt in cache-controlled blocks,
20+ tools with JSON schemas, thinking with a budget, `context_management`, `metadata`,
and (in newer versions) `role: "system"` entries inside `messages`. Codex speaks
/v1/responses: `instructions`, developer-role input, function / custom / namespace /
web_search tools, `reasoning`, `include`, `store: false`, `prompt_cache_key`.

Small bodies must stream complete, valid event sequences; bodies over the context must
get each API's typed 400 (which the agents parse to compact their history) at once.
The bodies here are written from the clients' field lists, not captured traffic.
"""

import json
import time

import anthropic
import httpx
import pytest
from server_helpers import Hook

SMALL_CONTEXT = 512  # the over-context server: the same bodies no longer fit

SCHEMA = "http://json-schema.org/draft-07/schema#"
CC_TOOL_NAMES = ["Task", "Bash", "Glob", "Grep", "ExitPlanMode", "Read", "Edit", "MultiEdit", "Write",
                 "NotebookEdit", "WebFetch", "TodoWrite", "WebSearch", "BashOutput", "KillShell", "SlashCommand",
                 "Skill", "AskUserQuestion", "mcp__ide__getDiagnostics", "mcp__ide__executeCode", "LS",
                 "EnterPlanMode"]


def cc_tool(i: int, name: str) -> dict:
    schema = {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}
    if i < 3:  # Claude Code's schemas carry these; a few suffice (the fixture tokenizer is ~1 token a byte)
        schema.update({"$schema": SCHEMA, "additionalProperties": False})
    tool = {"name": name, "description": f"{name} tool.", "input_schema": schema}
    if i == len(CC_TOOL_NAMES) - 1:
        tool["cache_control"] = {"type": "ephemeral"}
    return tool


PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}


def claude_code_body(last_user: str, *, history: bool = False, nonce: str = "7b4e2") -> dict:
    """A Claude-Code-like streaming request: its system prompt starts with the billing line
    Claude Code writes there, with a value that changes from request to request."""
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>Use TodoWrite.</system-reminder>"},
        {"type": "image", "source": PNG},  # `@shot.png` in the prompt
        {"type": "text", "text": "fix the bug", "cache_control": {"type": "ephemeral"}}]}]
    if history:
        messages += [
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Read it first.", "signature": "sig=="},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {"file_path": "/a.py"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "x = 1", "is_error": False},
                {"type": "tool_result", "tool_use_id": "toolu_02", "is_error": True,
                 "content": [{"type": "text", "text": "no such file"}, {"type": "image", "source": {}}]}]},
            {"role": "system", "content": "The user switched to plan mode."},
        ]
    messages.append({"role": "user", "content": [{"type": "text", "text": last_user}]})
    return {
        "model": "claude-sonnet-4-6", "max_tokens": 32000, "stream": True, "temperature": 1,
        "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{nonce[:3]}; "
                                            f"cc_entrypoint=cli; cch={nonce};"},
                   {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Be concise."}],
        "messages": messages,
        "tools": [cc_tool(i, n) for i, n in enumerate(CC_TOOL_NAMES)],
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": "user_0123_account__session_4567"},
    }


def codex_body(last_user: str, *, history: bool = False) -> dict:
    """A Codex-like streaming /v1/responses request."""
    fn = {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}},
                                           "workdir": {"type": "string"}}, "required": ["command"]}
    items = [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "<permissions instructions>sandbox: workspace-write</permissions instructions>"}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "<environment_context><cwd>/repo</cwd></environment_context>"}]},
    ]
    if history:
        items += [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Run ls."}],
             "content": None, "encrypted_content": "gAAAAB"},
            {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"command": ["ls"]}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"},
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Approval: never."}]},
        ]
    items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": last_user}]})
    return {
        "model": "gpt-5-codex", "instructions": "You are Codex, a coding agent.", "input": items, "stream": True,
        "tools": [{"type": "function", "name": "shell", "description": "Runs a command.", "strict": False,
                   "parameters": fn},
                  {"type": "function", "name": "update_plan", "parameters": {"type": "object", "properties": {}}},
                  {"type": "custom", "name": "apply_patch", "description": "Patch files.",
                   "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
                  {"type": "namespace", "name": "mcp__files__", "description": "Files.", "tools": [
                      {"type": "function", "name": "read", "parameters": {"type": "object", "properties": {
                          "path": {"type": "string"}}}}]},
                  {"type": "web_search"}],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": False,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0199-abcd",
        "text": {"verbosity": "low"},
    }


SCRIPTS = {
    "cc": ('<think>\nRead the file.\n</think>\n\nReading it.\n\n<tool_call>\n{"name": "Read", "arguments": '
           '{"file_path": "/repo/a.py"}}\n</tool_call>'),
    "codex": ('<think>\nList files.\n</think>\n\n<tool_call>\n{"name": "shell", "arguments": '
              '{"command": ["ls", "-la"]}}\n</tool_call>'),
    "text": "All done.",
    "docs": '<tool_call>\n{"name": "mcp__docs__search", "arguments": {"q": "rope"}}\n</tool_call>',
}


@pytest.fixture(scope="module")
def servers(start_server, server_model):
    hook = Hook(server_model[1], SCRIPTS)
    # The fixture tokenizer has few merges (~1 token a byte): 22 tools are ~6k tokens.
    big = start_server(hook=hook, context_length=16384, prefix_cache_mb=64)  # id: mlxmtp-demo
    small = start_server(hook=hook, context_length=SMALL_CONTEXT)
    return big, small


def events_of(text: str):
    """Raw SSE -> [(event name, data)], keep-alive comments dropped."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = [ln for ln in block.split("\n") if not ln.startswith(":")]
        if not lines:
            continue
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        data = json.loads(lines[1][6:])
        assert data["type"] == lines[0][7:]
        out.append((data["type"], data))
    return out


def check_anthropic_stream(events) -> list:
    """A valid Messages stream: start, blocks opened / filled / closed in order, delta, stop.
    Returns the content blocks rebuilt."""
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    blocks, open_index = [], None
    for name, d in events[1:-2]:
        if name == "ping":
            continue
        if name == "content_block_start":
            assert open_index is None and d["index"] == len(blocks)
            open_index = d["index"]
            blocks.append(dict(d["content_block"]))
        elif name == "content_block_delta":
            assert d["index"] == open_index
            delta, block = d["delta"], blocks[open_index]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                block["input"] = json.loads(delta["partial_json"])
        else:
            assert name == "content_block_stop" and d["index"] == open_index, name
            open_index = None
    assert open_index is None
    return blocks


def check_responses_stream(events) -> dict:
    """A valid Responses stream: numbered events, created / in_progress first, each item
    added then done, a final response.completed / incomplete. Returns the final response."""
    names = [n for n, _ in events]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert names[:2] == ["response.created", "response.in_progress"], names
    assert names[-1] in ("response.completed", "response.incomplete"), names
    added = [d["output_index"] for n, d in events if n == "response.output_item.added"]
    done = [d["output_index"] for n, d in events if n == "response.output_item.done"]
    assert added == done == list(range(len(added)))
    final = events[-1][1]["response"]
    assert [i["id"] for i in final["output"]] == [d["item"]["id"] for n, d in events
                                                  if n == "response.output_item.done"]
    return final


# ------------------------------------------------------------------ Claude Code
@pytest.mark.slow
@pytest.mark.parametrize("history", [False, True])
def test_claude_code_like_stream(servers, history):
    big, _ = servers
    body = claude_code_body("FORCE:cc", history=history)
    r = httpx.post(big.url + "/v1/messages?beta=true", json=body, timeout=120,
                   headers={"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14",
                            "x-api-key": "anything"})
    assert r.status_code == 200, r.text
    events = events_of(r.text)
    blocks = check_anthropic_stream(events)
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[0]["thinking"] == "Read the file." and blocks[1]["text"] == "Reading it."
    assert blocks[2]["name"] == "Read" and blocks[2]["input"] == {"file_path": "/repo/a.py"}
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["model"] == body["model"] and delta["delta"]["stop_reason"] == "tool_use"
    count = httpx.post(big.url + "/v1/messages/count_tokens?beta=true", timeout=60,
                       json={k: v for k, v in body.items() if k not in ("max_tokens", "stream")}).json()
    assert count["input_tokens"] == start["usage"]["input_tokens"] > 1000


def test_claude_code_sessions_reuse_one_prefill_whatever_their_billing_line(servers):
    # The billing line is not prompt: a request whose line differs reads the cached prefix
    # (system prompt, tools, history) a request with another line left, as Anthropic's
    # API does. Usage splits the prompt as Anthropic's does: the sum is count_tokens.
    big, _ = servers
    usages = []
    for nonce in ("a1b2c", "d3e4f"):
        body = claude_code_body("FORCE:text", history=True, nonce=nonce)
        r = httpx.post(big.url + "/v1/messages?beta=true", json=body, timeout=120)
        assert r.status_code == 200, r.text
        usages.append(events_of(r.text)[-2][1]["usage"])
    count = httpx.post(big.url + "/v1/messages/count_tokens", timeout=60,
                       json={k: v for k, v in body.items() if k not in ("max_tokens", "stream")}).json()
    assert usages[1]["cache_read_input_tokens"] > 1000
    assert [u["input_tokens"] + u["cache_read_input_tokens"] for u in usages] == [count["input_tokens"]] * 2
    assert all(u["cache_creation_input_tokens"] == 0 for u in usages)


def test_a_tool_claude_code_loads_later_keeps_the_cached_prompt(servers):
    # Claude Code defers MCP tools (defer_loading) and adds each one ToolSearch loads to
    # `tools`, mid-list. Deferred tools are not listed in the prompt, so the next request
    # reads the whole prompt from the prefix cache (listed, it would be prefilled again
    # from the tools on), and calls to the loaded tool still parse.
    big, _ = servers
    loaded = {"name": "mcp__docs__search", "description": "Search the docs.", "defer_loading": True,
              "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}
    placeholder = {"name": "DeferredToolPlaceholder", "description": "Never call it.", "defer_loading": True,
                   "input_schema": {"type": "object", "properties": {}}}
    usages = []
    for extra, script in (([], "text"), ([loaded], "text"), ([loaded], "docs")):
        body = claude_code_body(f"FORCE:{script}", history=True, nonce="a1b2c")
        body["tools"] = body["tools"][:1] + extra + body["tools"][1:] + [placeholder]
        r = httpx.post(big.url + "/v1/messages?beta=true", json=body, timeout=120)
        assert r.status_code == 200, r.text
        usages.append(events_of(r.text)[-2][1]["usage"])
    total = usages[0]["input_tokens"] + usages[0]["cache_read_input_tokens"]
    assert usages[1]["input_tokens"] + usages[1]["cache_read_input_tokens"] == total
    assert usages[1]["cache_read_input_tokens"] >= total - 1
    call = check_anthropic_stream(events_of(r.text))[-1]
    assert call["type"] == "tool_use" and call["name"] == "mcp__docs__search" and call["input"] == {"q": "rope"}


def test_claude_code_like_over_context_is_a_fast_400(servers):
    big, small = servers
    body = claude_code_body("hello", history=True)
    n = httpx.post(big.url + "/v1/messages/count_tokens", json=body, timeout=60).json()["input_tokens"]
    for stream in (True, False):
        t0 = time.perf_counter()
        r = httpx.post(small.url + "/v1/messages?beta=true", json=dict(body, stream=stream), timeout=60)
        assert time.perf_counter() - t0 < 1.0
        assert r.status_code == 400
        assert r.json() == {"type": "error", "error": {
            "type": "invalid_request_error", "message": f"prompt is too long: {n} tokens > {SMALL_CONTEXT - 1} maximum"}}
    # The SDK raises it as a typed error, as Claude Code sees it.
    ant = anthropic.Anthropic(base_url=small.url, api_key="x", max_retries=0, timeout=60)
    kw = {k: body[k] for k in ("model", "max_tokens", "system", "messages", "tools", "thinking", "metadata")}
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        ant.messages.create(**kw, extra_body={"context_management": body["context_management"]})


def test_anthropic_sdk_with_a_mid_conversation_system_message(servers):
    big, _ = servers
    ant = anthropic.Anthropic(base_url=big.url, api_key="x", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "FORCE:text"}]
    m = ant.messages.create(model="claude-opus-4-1", max_tokens=50, system="Be short.", messages=messages,
                            extra_body={"context_management": {"edits": []}}, metadata={"user_id": "u"})
    assert m.content[0].text == "All done." and m.model == "claude-opus-4-1"
    with ant.messages.stream(model="claude-opus-4-1", max_tokens=50, system="Be short.", messages=messages) as s:
        assert s.get_final_text() == "All done."
    n = ant.messages.count_tokens(model="claude-opus-4-1", system="Be short.", messages=messages)
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


# ------------------------------------------------------------------ Codex
@pytest.mark.parametrize("history", [False, True])
def test_codex_like_stream(servers, history):
    big, _ = servers
    body = codex_body("FORCE:codex", history=history)
    r = httpx.post(big.url + "/v1/responses", json=body, timeout=120, headers={"authorization": "Bearer x"})
    assert r.status_code == 200, r.text
    # Hosted and custom (freeform) tools cannot run here: left out, and said so.
    assert "web_search" in r.headers["x-mlxmtp-warning"] and "custom" in r.headers["x-mlxmtp-warning"]
    final = check_responses_stream(events_of(r.text))
    assert final["status"] == "completed" and final["model"] == "gpt-5-codex" and final["store"] is False
    assert [i["type"] for i in final["output"]] == ["reasoning", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "List files."
    call = final["output"][1]
    assert call["name"] == "shell" and json.loads(call["arguments"]) == {"command": ["ls", "-la"]}


def test_codex_like_over_context_is_a_fast_400(servers):
    _, small = servers
    body = codex_body("hello", history=True)
    for stream in (True, False):
        t0 = time.perf_counter()
        r = httpx.post(small.url + "/v1/responses", json=dict(body, stream=stream), timeout=60)
        assert time.perf_counter() - t0 < 1.0
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "input"
        assert f"maximum context length is {SMALL_CONTEXT} tokens" in err["message"]


def test_chat_completions_over_context_is_typed(servers):
    _, small = servers
    body = {"model": "gpt-4o", "stream": True, "messages": [
        {"role": "system", "content": "x " * SMALL_CONTEXT}, {"role": "user", "content": "hi"}]}
    t0 = time.perf_counter()
    r = httpx.post(small.url + "/v1/chat/completions", json=body, timeout=60)
    assert time.perf_counter() - t0 < 1.0
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"

