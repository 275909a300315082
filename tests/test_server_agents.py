"""Request bodies shaped like the coding agents' own, replayed against a real server.

Claude Code speaks /v1/messages?beta=true: a system prompt in cache-controlled blocks,
20+ tools with JSON schemas, thinking with a budget, `context_management`, `metadata`,
and (in newer versions) `role: "system"` entries inside `messages`. Codex speaks
/v1/responses: `instructions`, developer-role input, function / custom / namespace /
web_search tools, `reasoning`, `include`, `store: false`, `prompt_cache_key`.

Small bodies must stream complete, valid event sequences; bodies over the context must
get each API's typed 400 (which the agents parse to compact their history) at once.
Those two bodies are written from the clients' field lists, not captured traffic.

Qwen Code and OpenCode speak /v1/chat/completions; their bodies are cut down from requests
they sent (Qwen Code 0.24.4, OpenCode 1.18.33 with `@ai-sdk/openai-compatible`): every field
and value type kept, the system prompt and tools shortened. Their streams are read as those
clients read them (chat_stream), through a tool call, its result and the answer.
"""

import json
import re
import time

import anthropic
import httpx
import pytest
from server_helpers import Hook, served_engine

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


def fn_tool(name: str, description: str, parameters=None) -> dict:
    """An OpenAI chat completions tool; without `parameters` as Qwen Code sends its
    argument-less tools (no `parameters` key at all)."""
    f = {"name": name, "description": description}
    if parameters is not None:
        f["parameters"] = parameters
    return {"type": "function", "function": f}


# Five of the ten tools Qwen Code 0.24.4 sends (captured), descriptions cut, schema keywords
# kept: a tool with no `parameters`, null in a type list, oneOf with a pattern, minLength,
# additionalProperties false.
QWEN_TOOLS = [
    fn_tool("agent", "Launch a new agent.", {
        "type": "object", "properties": {
            "description": {"type": "string", "description": "A short (3-5 word) description of the task"},
            "prompt": {"type": "string"},
            "fork_turns": {"oneOf": [{"type": "string", "enum": ["all"]},
                                     {"type": "string", "pattern": "^[1-9][0-9]*$"}]},
            "run_in_background": {"type": "boolean", "default": True}},
        "required": ["description", "prompt"]}),
    fn_tool("get_goal", "Read the current Goal."),
    fn_tool("glob", "Fast file pattern matching.", {
        "properties": {"pattern": {"description": "The glob pattern", "type": "string"},
                       "path": {"type": "string"}},
        "required": ["pattern"], "type": "object"}),
    fn_tool("read_file", "Reads a file.", {
        "properties": {"file_path": {"type": "string"}, "offset": {"type": ["integer", "null"]}},
        "required": ["file_path"], "type": "object"}),
    fn_tool("tool_call", "Call a deferred tool.", {
        "type": "object", "properties": {"name": {"type": "string", "minLength": 1}, "arguments": {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False}),
]


def qwen_code_body(task: str, *, call: dict = None) -> dict:
    """A Qwen Code 0.24.4 request as captured: a system prompt, the task as a user message of
    text parts after <system-reminder> parts, tools, `max_tokens` 32000, a stream with usage.
    With `call` (an OpenAI tool call object), the next turn: the assistant's call with
    `content: null`, and the tool's result as text parts."""
    messages = [
        {"role": "system", "content": "You are Qwen Code, a non-interactive CLI agent developed by Alibaba Group."},
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>\nThe current date is: Wednesday, December 2, 2026.\n"
                                     "</system-reminder>"},
            {"type": "text", "text": task}]}]
    if call:
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": [
                         {"type": "text", "text": 'Found 2 file(s) matching "*":\n---\n/w/notes.txt\n/w/a.py'
                                                  "\nFORCE:files-answer"}]}]
    return {"model": "mlxmtp-demo", "messages": messages, "max_tokens": 32000, "stream": True,
            "stream_options": {"include_usage": True}, "tools": QWEN_TOOLS}


QWEN_HEADERS = {"user-agent": "QwenCode/0.24.4 (linux; x64)", "authorization": "Bearer anything",
                "x-stainless-lang": "js", "x-stainless-package-version": "5.11.0"}

# Three of OpenCode 1.18.33's ten tools (captured), descriptions cut, as its zod schemas come
# out: the 2020-12 `$schema`, integers bounded by +-(2^53-1) with exclusiveMinimum, enum, default.
OC_SCHEMA = "https://json-schema.org/draft/2020-12/schema"
OPENCODE_TOOLS = [
    fn_tool("bash", "Executes a given bash command.", {
        "$schema": OC_SCHEMA, "type": "object", "properties": {
            "command": {"type": "string", "description": "The command to execute"},
            "timeout": {"minimum": -9007199254740991, "exclusiveMinimum": 0, "type": "integer",
                        "maximum": 9007199254740991},
            "workdir": {"type": "string"}},
        "required": ["command"]}),
    fn_tool("todowrite", "Maintain a task list.", {
        "$schema": OC_SCHEMA, "type": "object", "properties": {"todos": {"type": "array", "items": {
            "type": "object", "properties": {"content": {"type": "string"}, "status": {"type": "string"}},
            "required": ["content", "status"]}}},
        "required": ["todos"]}),
    fn_tool("webfetch", "Fetches a URL.", {
        "$schema": OC_SCHEMA, "type": "object", "properties": {
            "url": {"type": "string"},
            "format": {"type": "string", "enum": ["text", "markdown"], "default": "markdown"},
            "timeout": {"type": "number"}},
        "required": ["url"]}),
]
OPENCODE_HEADERS = {"user-agent": "opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14",
                    "x-session-affinity": "ses_dcb33eb77ffe", "x-session-id": "ses_dcb33eb77ffe"}


def opencode_body(task: str, *, call: dict = None) -> dict:
    """An OpenCode 1.18.33 request (`@ai-sdk/openai-compatible`) as captured: `max_tokens`
    (limit.output, 32000 by default), string contents, tools with `tool_choice: "auto"`, a
    stream with usage. With `call`, the next turn: the assistant's call with `content: ""`
    and the tool's output as a string."""
    messages = [{"role": "system", "content": "You are opencode, an interactive CLI tool that helps users with "
                                              "software engineering tasks."},
                {"role": "user", "content": task}]
    if call:
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": "a.py\nnotes.txt\nFORCE:files-answer\n"}]
    return {"model": "mlxmtp-demo", "max_tokens": 32000, "messages": messages, "tools": OPENCODE_TOOLS,
            "tool_choice": "auto", "stream": True, "stream_options": {"include_usage": True}}


def opencode_title_body(task: str) -> dict:
    """OpenCode's title request, sent beside a session's first turn: no tools, two user
    messages in a row."""
    return {"model": "mlxmtp-demo", "max_tokens": 32000, "messages": [
        {"role": "system", "content": "You are a title generator. You output ONLY a thread title. Nothing else."},
        {"role": "user", "content": "Generate a title for this conversation:\n"},
        {"role": "user", "content": json.dumps(task)}],
        "stream": True, "stream_options": {"include_usage": True}}


SCRIPTS = {
    "cc": ('<think>\nRead the file.\n</think>\n\nReading it.\n\n<tool_call>\n{"name": "Read", "arguments": '
           '{"file_path": "/repo/a.py"}}\n</tool_call>'),
    "codex": ('<think>\nList files.\n</think>\n\n<tool_call>\n{"name": "shell", "arguments": '
              '{"command": ["ls", "-la"]}}\n</tool_call>'),
    "text": "All done.",
    "docs": '<tool_call>\n{"name": "mcp__docs__search", "arguments": {"q": "rope"}}\n</tool_call>',
    "qwen": '<tool_call>\n{"name": "glob", "arguments": {"pattern": "*"}}\n</tool_call>',
    "opencode": '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>',
    # after the tool's result (the marker rides in it; the longest marker in a body wins)
    "files-answer": "Two files: a.py and notes.txt.",
    # tool_choice "required": the prompt ends with the call's opening, the model writes the rest;
    # each script breaks its tool's schema, which the call's grammar must not let through.
    "required-qwen-pattern": ('{"name": "agent", "arguments": {"description": "d", "prompt": "p", '
                              '"fork_turns": "07"}}\n</tool_call>'),
    "required-qwen-null": '{"name": "read_file", "arguments": {"file_path": "/w/a.py", "offset": nil}}\n</tool_call>',
    "required-oc": '{"name": "bash", "arguments": {"command": "ls", "timeout": 0}}\n</tool_call>',
}


class RecordingHook(Hook):
    """Hook that also keeps the last prompt, rendered."""

    prompt = ""

    def __call__(self, req, body):
        self.prompt = self.tok.decode(req.prompt)
        super().__call__(req, body)


@pytest.fixture(scope="module")
def servers(start_server, server_model):
    hook = RecordingHook(server_model[1], SCRIPTS)
    # The fixture tokenizer has few merges (~1 token a byte): 22 tools are ~6k tokens.
    big = start_server(hook=hook, context_length=16384, engine=served_engine(prefix_cache_bytes=64 << 20))  # id: mlxmtp-demo
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


def chat_stream(text: str) -> dict:
    """A chat completions stream read the way Qwen Code (the openai SDK) and OpenCode (the AI
    SDK) read it: `data:` lines of chat.completion.chunk ending with [DONE]; a tool call
    opened by a delta with its index, id and function name, its arguments appended after
    (the AI SDK takes a call as done once its arguments parse as JSON, and drops any later
    delta of it); with `stream_options.include_usage`, the usage in a last chunk of no
    choices. Returns the reply rebuilt: content, calls, finish reason, usage."""
    blocks = text.strip().split("\n\n")
    assert blocks[-1] == "data: [DONE]", blocks[-1]
    chunks = []
    for block in blocks[:-1]:
        assert block.startswith("data: {") and "\n" not in block, block
        chunks.append(json.loads(block[6:]))
    assert {(c["object"], c["id"], c["model"]) for c in chunks} == {
        ("chat.completion.chunk", chunks[0]["id"], chunks[0]["model"])}
    usage = chunks[-1].get("usage")
    if usage is not None:
        assert chunks[-1]["choices"] == [] and all(c.get("usage") is None for c in chunks[:-1])
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        chunks = chunks[:-1]
    content, calls, finishes = "", [], []
    for c in chunks:
        (choice,) = c["choices"]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            if tc["index"] == len(calls):  # a new call
                assert tc.get("type") == "function" and tc.get("id") and tc["function"].get("name"), tc
                calls.append({"id": tc["id"], "name": tc["function"]["name"],
                              "arguments": tc["function"].get("arguments") or "", "done": False})
            else:
                call = calls[tc["index"]]
                assert not call["done"] and "id" not in tc, tc
                call["arguments"] += tc["function"].get("arguments") or ""
            try:
                json.loads(calls[tc["index"]]["arguments"])
                calls[tc["index"]]["done"] = True
            except ValueError:
                pass
        if choice["finish_reason"] is not None:
            finishes.append(choice["finish_reason"])
    assert len(finishes) == 1 and chunks[-1]["choices"][0]["finish_reason"] == finishes[0], finishes
    assert all(call["done"] for call in calls), calls
    return {"content": content, "finish_reason": finishes[0], "usage": usage, "model": chunks[0]["model"],
            "calls": [{"id": cl["id"], "type": "function",
                       "function": {"name": cl["name"], "arguments": cl["arguments"]}} for cl in calls]}


def post_chat(server, body: dict, headers: dict) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return chat_stream(r.text)


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


# ------------------------------------------------------------------ Qwen Code, OpenCode (chat completions)
@pytest.mark.parametrize("client", ["qwen", "opencode"])
def test_chat_agent_tool_call_round_trip(servers, client):
    # One turn as each client runs it: its request, a tool call streamed back, the call and
    # the tool's result sent back as the client sends them, and the answer.
    big, _ = servers
    body_of, headers = {"qwen": (qwen_code_body, QWEN_HEADERS), "opencode": (opencode_body, OPENCODE_HEADERS)}[client]
    want = {"qwen": ("glob", {"pattern": "*"}), "opencode": ("bash", {"command": "ls"})}[client]
    task = f"list the files in this folder FORCE:{client}"
    first = post_chat(big, body_of(task), headers)
    assert first["model"] == "mlxmtp-demo" and first["finish_reason"] == "tool_calls" and first["content"] == ""
    (call,) = first["calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == want
    assert first["usage"]["completion_tokens"] > 10 and first["usage"]["prompt_tokens"] > 1000
    # The clients send the call back as they rebuilt it (their own JSON spacing).
    call["function"]["arguments"] = json.dumps(json.loads(call["function"]["arguments"]), separators=(",", ":"))
    second = post_chat(big, body_of(task, call=call), headers)
    assert second["finish_reason"] == "stop" and second["calls"] == []
    assert second["content"] == "Two files: a.py and notes.txt."
    # The model reads its call as it wrote it, and the tool's result (text parts joined).
    prompt = big.hook.prompt
    assert SCRIPTS[client] + "<|im_end|>" in prompt
    result = prompt.split("<tool_response>\n", 1)[1].split("</tool_response>")[0]
    assert result.startswith({"qwen": 'Found 2 file(s) matching "*":\n', "opencode": "a.py\nnotes.txt\n"}[client])
    usage = second["usage"]
    assert usage["prompt_tokens"] > first["usage"]["prompt_tokens"]
    # So the turn before, its prompt and the call, is read from the prefix cache.
    assert usage["prompt_tokens_details"]["cached_tokens"] > first["usage"]["prompt_tokens"]


def test_opencode_title_request(servers):
    # Sent beside the session's first turn: no tools, two user messages in a row.
    big, _ = servers
    reply = post_chat(big, opencode_title_body("list the files in this folder FORCE:text"), OPENCODE_HEADERS)
    assert reply["content"] == "All done." and reply["finish_reason"] == "stop" and reply["calls"] == []
    assert reply["usage"]["completion_tokens"] > 1


@pytest.mark.parametrize("script", ["required-qwen-pattern", "required-qwen-null", "required-oc"])
def test_chat_agent_required_tool_call_holds_to_its_schemas(servers, script):
    # `tool_choice: "required"` (Qwen Code sends it when a turn must call a tool) holds the
    # call to a grammar of the client's tool schemas as it writes them: each scripted call
    # breaks its schema (a pattern, an integer-or-null, exclusiveMinimum 0), and what comes
    # back is the scripted call bent back into its schema.
    big, _ = servers
    qwen = script.startswith("required-qwen")
    body = (qwen_code_body if qwen else opencode_body)(f"do it FORCE:{script}")
    body["tool_choice"] = "required"
    reply = post_chat(big, body, QWEN_HEADERS if qwen else OPENCODE_HEADERS)
    assert big.hook.prompt.endswith("<|im_start|>assistant\n<tool_call>\n")
    assert reply["finish_reason"] == "tool_calls" and reply["content"] == ""
    (call,) = reply["calls"]
    name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
    if script == "required-qwen-pattern":  # scripted "07"
        assert (name, args["description"], args["prompt"]) == ("agent", "d", "p")
        assert re.fullmatch("[1-9][0-9]*", args["fork_turns"]), args
    elif script == "required-qwen-null":  # scripted nil
        assert (name, args) == ("read_file", {"file_path": "/w/a.py", "offset": None})
    else:  # scripted 0
        assert name == "bash" and args["command"] == "ls" and args["timeout"] > 0, args
