"""What coding agents need from the server, end to end on the fixture model: any model
name answered, system messages inside `messages`, beta fields ignored, a thinking budget,
count_tokens equal to the prefill, keep-alives before the first token, and tool_choice
enforced (required / any / a named tool) on all three APIs.

Outputs are scripted with server_helpers.Hook (a one-hot logits processor): the engine,
HTTP, SSE and parsers run for real. `Recorder` also keeps each prompt the engine got.
"""

import json
import time

import anthropic
import httpx
import mlx.core as mx
import openai
import pytest
from server_helpers import Hook

from mlxmtp.server import generation
from mlxmtp.server.chat import tool_call_opening
from mlxmtp.server.reasoning import OutputSplitter
from mlxmtp.server.thinking_budget import budget_processor
from mlxmtp.testing.fixtures import CHAT_TEMPLATE, write_tokenizer

MODEL = "fixture"
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": PARAMS}, {"name": "get_time", "input_schema": {}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": PARAMS},
                   {"type": "function", "name": "get_time", "parameters": {"type": "object"}}]
SCRIPTS = {
    "required": '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "named": ' {"city": "Oslo"}}\n</tool_call>',  # after '<tool_call>\n{"name": "get_weather", "arguments":'
    "budget": "<think>\nalpha beta gamma delta epsilon zeta eta theta\n</think>\n\nDone.",
    "open": "I should greet the user warmly.\n</think>\n\nHi!",
    "hello": "Hello!",
}
OPENS_THINK = ("{%- if enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}",
               "{%- if enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}"
               "\n    {%- else %}\n        {{- '<think>\\n' }}")
SYSTEM_FIRST_ONLY = ('{%- if (message.role == "user") or (message.role == "system" and not loop.first) %}',
                     '{%- if message.role == "system" and not loop.first %}'
                     "{{- raise_exception('System message must be at the beginning.') }}"
                     '{%- elif message.role == "user" %}')


class Recorder(Hook):
    """Hook that also keeps the prompt text of every request, and can delay the first or
    the second token."""

    def __init__(self, tok):
        super().__init__(tok)
        self.scripts.update(SCRIPTS)
        self.prompts = []

    def __call__(self, req, body):
        self.prompts.append(self.tok.decode(req.prompt))
        super().__call__(req, body)
        for mark, after in (("SLOW:first", 0), ("SLOW:later", 2)):
            if mark in json.dumps(body):
                n = len(req.prompt) + after

                def slow(ctx, logits, n=n):  # a long prefill (or a wait for memory), as seen from the client
                    if ctx.shape[0] == n:
                        time.sleep(0.6)
                    return logits

                req.params.logits_processors.append(slow)


def _serve(start_server, tok, **kw):
    return start_server(hook=Recorder(tok), tok=tok, model_id=MODEL, **kw)


@pytest.fixture(scope="module")
def server(start_server, server_model):
    return _serve(start_server, server_model[1], aliases=["my-alias"])


def _qwen35_tokenizer(tmp_path_factory):
    """A Qwen3.5-like template: opens <think> in the generation prompt, and takes a system
    message only first."""
    from mlx_lm.tokenizer_utils import load as load_tok

    tok = load_tok(write_tokenizer(tmp_path_factory.mktemp("tok35")))
    tok._tokenizer.chat_template = CHAT_TEMPLATE.replace(*OPENS_THINK).replace(*SYSTEM_FIRST_ONLY)
    return tok


@pytest.fixture(scope="module")
def qwen35(start_server, tmp_path_factory):
    return _serve(start_server, _qwen35_tokenizer(tmp_path_factory))


def clients(srv):
    return (openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60),
            anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60))


def sse(text):
    """Raw SSE text -> (comments, [(event name or None, data)])."""
    comments, events = [], []
    for block in text.strip().split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith(":"):
                comments.append(line)
            elif line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            events.append((name, json.loads(data) if data != "[DONE]" else data))
    return comments, events


# ------------------------------------------------------------------ model names
def test_any_model_name_is_answered_under_that_name(server):
    oai, ant = clients(server)
    user = [{"role": "user", "content": "x"}]
    assert oai.chat.completions.create(model="gpt-4o", messages=user, max_tokens=2).model == "gpt-4o"
    assert oai.completions.create(model="text-davinci", prompt="x", max_tokens=2).model == "text-davinci"
    assert oai.responses.create(model="gpt-5-codex", input="x", max_output_tokens=2).model == "gpt-5-codex"
    assert ant.messages.create(model="claude-sonnet-9", max_tokens=2, messages=user).model == "claude-sonnet-9"
    with ant.messages.stream(model="claude-haiku-9", max_tokens=2, messages=user) as s:
        assert s.get_final_message().model == "claude-haiku-9"
    chunks = list(oai.chat.completions.create(model="o3", messages=user, max_tokens=2, stream=True))
    assert {c.model for c in chunks} == {"o3"}
    assert [m.id for m in oai.models.list().data] == [MODEL, "my-alias"]
    assert oai.models.retrieve("anything").id == "anything"


# ------------------------------------------------------------------ system messages, beta fields
def test_system_messages_inside_messages(server, qwen35):
    conv = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
            {"role": "system", "content": "Be brief now."}, {"role": "user", "content": "second"}]
    for srv in (server, qwen35):
        _, ant = clients(srv)
        # A leading one joins the system prompt.
        a = ant.messages.count_tokens(model="m", system="S", messages=[
            {"role": "system", "content": [{"type": "text", "text": "A"}]}, {"role": "user", "content": "hi"}])
        b = ant.messages.count_tokens(model="m", system="S\n\nA", messages=[{"role": "user", "content": "hi"}])
        assert a.input_tokens == b.input_tokens
        m = ant.messages.create(model="m", max_tokens=2, messages=conv, thinking={"type": "disabled"})
        assert m.usage.output_tokens == 2
    # The fixture template renders a later system turn; the Qwen3.5-like one raises on it,
    # so it is folded into the next user turn behind a marker.
    assert "<|im_start|>system\nBe brief now.<|im_end|>\n<|im_start|>user\nsecond" in server.hook.prompts[-1]
    assert "<|im_start|>user\n[System]\nBe brief now.\n\nsecond<|im_end|>" in qwen35.hook.prompts[-1]
    # Same for OpenAI chat and Responses (a developer message mid-conversation).
    oai, _ = clients(qwen35)
    oai.chat.completions.create(model="m", max_tokens=1, messages=conv)
    assert "[System]\nBe brief now.\n\nsecond" in qwen35.hook.prompts[-1]
    oai.responses.create(model="m", max_output_tokens=1, input=[
        {"role": "user", "content": "first"}, {"role": "developer", "content": "Be brief now."},
        {"role": "user", "content": "second"}])
    assert "[System]\nBe brief now.\n\nsecond" in qwen35.hook.prompts[-1]
    # With nothing after it, the note is a user turn of its own.
    oai.chat.completions.create(model="m", max_tokens=1, messages=conv[:3])
    assert qwen35.hook.prompts[-1].endswith("<|im_start|>user\n[System]\nBe brief now.<|im_end|>\n"
                                            "<|im_start|>assistant\n<think>\n")


def test_beta_fields_and_query_are_ignored(server):
    body = {"model": "claude-opus-4-1", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}],
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "low"}, "metadata": {"user_id": "u_1"}}
    r = httpx.post(server.url + "/v1/messages?beta=true", json=body, headers={
        "anthropic-beta": "context-management-2025-06-27", "anthropic-version": "2023-06-01"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] == 3
    body.pop("max_tokens")
    n = httpx.post(server.url + "/v1/messages/count_tokens?beta=true", json=body, timeout=60).json()
    assert n["input_tokens"] == r.json()["usage"]["input_tokens"]


# ------------------------------------------------------------------ thinking budget
def test_budget_processor_changes_nothing_until_hit():
    P, S, E = 3, 10, 11
    logits = mx.random.normal((1, 16))

    def ctx(gen):
        return mx.array([1, 2, 3] + gen, dtype=mx.int32)

    inside = budget_processor(P, 4, S, E, starts_inside=True)
    assert inside(ctx([5, 5, 5]), logits) is logits
    assert mx.argmax(inside(ctx([5, 5, 5, 5]), logits)).item() == E
    assert mx.array_equal(inside(ctx([5, E, 5, 5]), logits), logits).item()  # closed already
    opened = budget_processor(P, 2, S, E, starts_inside=False)
    assert mx.array_equal(opened(ctx([5, 5, 5]), logits), logits).item()  # never opened
    assert mx.array_equal(opened(ctx([S, 5]), logits), logits).item()  # 1 reasoning token
    assert mx.argmax(opened(ctx([S, 5, 5]), logits)).item() == E
    assert mx.array_equal(opened(ctx([S, 5, E, 5]), logits), logits).item()


def test_thinking_budget_closes_the_reasoning(server, qwen35):
    tok = server.hook.tok
    _, ant = clients(server)
    ids = tok.encode(SCRIPTS["budget"], add_special_tokens=False)

    def ask(ant, budget, force):
        return ant.messages.create(model="m", max_tokens=400, thinking={"type": "enabled", "budget_tokens": budget},
                                   messages=[{"role": "user", "content": f"FORCE:{force}"}])

    # The fixture template lets the model open <think>: 4 reasoning tokens, then </think>.
    m = ask(ant, 4, "budget")
    assert m.content[0].type == "thinking" and m.content[0].thinking == tok.decode(ids[1:5]).strip()
    free = ask(ant, 100, "budget")  # a budget not reached changes nothing
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in free.content] == [
        ("thinking", "alpha beta gamma delta epsilon zeta eta theta"), ("text", "Done.")]
    # A template that opens <think> itself: the reasoning starts with the output.
    _, ant35 = clients(qwen35)
    ids = tok.encode(SCRIPTS["open"], add_special_tokens=False)
    m = ask(ant35, 3, "open")
    assert m.content[0].thinking == tok.decode(ids[:3]).strip()
    assert [b.type for b in ask(ant35, 50, "open").content] == ["thinking", "text"]


# ------------------------------------------------------------------ count_tokens, keep-alive
@pytest.mark.slow
def test_count_tokens_is_the_prefill(server, qwen35):
    for srv in (server, qwen35):
        _, ant = clients(srv)
        kw = dict(system="S", tools=ANTHROPIC_TOOLS, messages=[
            {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "system", "content": "note"}, {"role": "user", "content": "c"}])
        for extra in ({}, {"tool_choice": {"type": "any"}}, {"tool_choice": {"type": "tool", "name": "get_time"}},
                      {"thinking": {"type": "enabled", "budget_tokens": 2000}}):
            n = ant.messages.count_tokens(model="m", **kw, **extra).input_tokens
            m = ant.messages.create(model="m", max_tokens=1, **kw, **extra)
            assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens == \
                len(srv.hook.tok.encode(srv.hook.prompts[-1], add_special_tokens=False))


def test_the_server_s_template_variables_hold_unless_a_request_sets_its_own(start_server, qwen35, tmp_path_factory):
    # `serve --chat-template-args '{"enable_thinking": false}'`: agents send no template
    # variables (Claude Code's main turns ask for 'adaptive' thinking: the server decides).
    quiet = _serve(start_server, _qwen35_tokenizer(tmp_path_factory), chat_template_args={"enable_thinking": False})
    user = [{"role": "user", "content": "hi"}]
    asks = {
        "chat": lambda oai, ant, **kw: oai.chat.completions.create(model="m", max_tokens=1, messages=user, **kw),
        "responses": lambda oai, ant, **kw: oai.responses.create(model="m", max_output_tokens=1, input="hi", **kw),
        "messages": lambda oai, ant, **kw: ant.messages.create(model="m", max_tokens=1, messages=user, **kw),
    }
    cases = [("chat", {}), ("chat", {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}),
             ("chat", {"extra_body": {"enable_thinking": True}}), ("chat", {"reasoning_effort": "high"}),
             ("chat", {"reasoning_effort": "minimal"}),
             ("responses", {}), ("responses", {"reasoning": {"effort": "high"}}),
             ("messages", {}), ("messages", {"thinking": {"type": "adaptive"}}),
             ("messages", {"thinking": {"type": "enabled", "budget_tokens": 100}}),
             ("messages", {"thinking": {"type": "disabled"}})]
    opens = {}
    for name, srv in (("default", qwen35), ("quiet", quiet)):
        oai, ant = clients(srv)
        for api, kw in cases:
            asks[api](oai, ant, **kw)
            prompt = srv.hook.prompts[-1]
            assert prompt.endswith(("<think>\n", "<think>\n\n</think>\n\n")), prompt
            opens[name, api, json.dumps(kw)] = prompt.endswith("<think>\n")
    # In the order of `cases`: thinking opens where the request asks for it, else as the
    # server says (the template's default: open).
    assert [opens["quiet", api, json.dumps(kw)] for api, kw in cases] == [0, 1, 1, 1, 0, 0, 1, 0, 0, 1, 0]
    assert [opens["default", api, json.dumps(kw)] for api, kw in cases] == [1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0]
    _, ant = clients(quiet)
    m = ant.messages.create(model="m", max_tokens=1, messages=user, thinking={"type": "adaptive"})
    n = ant.messages.count_tokens(model="m", messages=user, thinking={"type": "adaptive"}).input_tokens
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_a_prefilled_answer_is_continued(server, qwen35):
    # Anthropic's prefill: a last assistant message is the start of the answer, which
    # continues it (the turn is left open), and the reply holds only what follows.
    for srv in (server, qwen35):
        _, ant = clients(srv)
        messages = [{"role": "user", "content": "Write a function."}, {"role": "assistant", "content": "def foo("}]
        m = ant.messages.create(model="m", max_tokens=3, messages=messages)
        prompt = srv.hook.prompts[-1]
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\ndef foo("), prompt
        assert ant.messages.count_tokens(model="m", messages=messages).input_tokens == \
            m.usage.input_tokens + m.usage.cache_read_input_tokens
        with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
            ant.messages.create(model="m", max_tokens=3, messages=[messages[0], {"role": "assistant", "content": "x "}])
        with pytest.raises(anthropic.BadRequestError, match="prefilled"):
            ant.messages.create(model="m", max_tokens=3, messages=messages, tools=ANTHROPIC_TOOLS,
                                tool_choice={"type": "any"})


def _has_token(block: str) -> bool:
    data = block.split("data: ", 1)[-1]
    if not data.startswith("{"):
        return False
    d = json.loads(data)
    if d.get("type") in ("response.output_text.delta", "content_block_delta"):
        return True
    return any(c.get("text") or (c.get("delta") or {}).get("content") for c in d.get("choices", []))


def _is_keepalive(block: str) -> bool:
    """An SSE comment, Anthropic's ping, or (chat completions) a chunk of no text and no role."""
    if block.startswith("data: {") and '"chat.completion.chunk"' in block:
        choice = json.loads(block[len("data: "):])["choices"][0]
        return choice["delta"] == {"content": ""} and choice["finish_reason"] is None
    return block == ": keep-alive" or block.startswith("event: ping")


@pytest.mark.slow
@pytest.mark.parametrize("mark", ["SLOW:first", "SLOW:later"])
def test_keepalive_while_no_token_comes(server, monkeypatch, mark):
    """A stream that waits for a token (the first: a long prefill; a later one: a request
    paused for memory) sends its API's keep-alive meanwhile."""
    monkeypatch.setattr(generation, "KEEPALIVE_SECONDS", 0.05)
    user = [{"role": "user", "content": mark}]
    # One token per step (num_draft 0): the third token's step is the slow one, after the
    # first two went out.
    cases = [("/v1/messages", {"max_tokens": 3, "messages": user}),
             ("/v1/chat/completions", {"max_tokens": 3, "messages": user}),
             ("/v1/completions", {"max_tokens": 3, "prompt": mark}),
             ("/v1/responses", {"max_output_tokens": 3, "input": mark})]
    for path, body in cases:
        r = httpx.post(server.url + path, json={"model": "m", "stream": True, "num_draft": 0, **body}, timeout=60)
        comments, events = sse(r.text)
        if path == "/v1/messages":
            names = [n for n, _ in events]
            assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop" and not comments
        blocks = r.text.strip().split("\n\n")
        first = min(i for i, b in enumerate(blocks) if _has_token(b))
        waiting = blocks[first:] if mark == "SLOW:later" else blocks[:first]
        assert sum(map(_is_keepalive, waiting)) >= 3, (path, blocks)
        if path == "/v1/chat/completions":  # data, which clients that skip comments still see
            assert not comments, comments


# ------------------------------------------------------------------ tool_choice enforced
def test_tool_call_opening_formats():
    class Tok:
        chat_template = "... {{- '<tool_call>\\n<function=' + name + '>\\n' }} ..."

    class JsonTok:
        chat_template = CHAT_TEMPLATE

    assert tool_call_opening(Tok()) == "<tool_call>\n<function="
    assert tool_call_opening(Tok(), "edit") == "<tool_call>\n<function=edit>\n"
    assert tool_call_opening(JsonTok()) == "<tool_call>\n"
    assert tool_call_opening(JsonTok(), "get_weather") == '<tool_call>\n{"name": "get_weather", "arguments":'
    # The splitter takes the opening as already written: the model's continuation is a call.
    sp = OutputSplitter(tools=TOOLS, emitted=tool_call_opening(Tok(), "get_weather"))
    out = sp.feed("<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>") + sp.finish()
    assert out == [("tool_call", {"name": "get_weather", "arguments": {"city": "Paris"}})]
    sp = OutputSplitter(tools=TOOLS, emitted=tool_call_opening(JsonTok()))
    assert sp.feed('{"name": "get_time", "arguments": {}}\n</tool_call>') + sp.finish() == [
        ("tool_call", {"name": "get_time", "arguments": {}})]


@pytest.mark.slow
def test_tool_choice_forces_the_call_openai_chat(server):
    oai, _ = clients(server)
    msgs = [{"role": "user", "content": "FORCE:required weather?"}]
    r = oai.chat.completions.create(model="m", max_tokens=200, messages=msgs, tools=TOOLS, tool_choice="required")
    assert server.hook.prompts[-1].endswith("<|im_start|>assistant\n<tool_call>\n")
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert (c.message.tool_calls[0].function.name, json.loads(c.message.tool_calls[0].function.arguments)) == \
        ("get_weather", {"city": "Paris"})
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(oai.chat.completions.create(model="m", max_tokens=200, tools=TOOLS, tool_choice=named, stream=True,
                                              messages=[{"role": "user", "content": "FORCE:named"}]))
    assert server.hook.prompts[-1].endswith('<tool_call>\n{"name": "get_weather", "arguments":')
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert calls[0].function.name == "get_weather" and json.loads(calls[1].function.arguments) == {"city": "Oslo"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # auto / none leave the turn to the model.
    oai.chat.completions.create(model="m", max_tokens=1, messages=msgs, tools=TOOLS, tool_choice="auto")
    assert server.hook.prompts[-1].endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_tool_choice_forces_the_call_anthropic(server):
    _, ant = clients(server)
    m = ant.messages.create(model="m", max_tokens=200, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
                            messages=[{"role": "user", "content": "FORCE:required"}])
    assert server.hook.prompts[-1].endswith("<|im_start|>assistant\n<tool_call>\n")
    assert m.stop_reason == "tool_use" and [(b.type, b.name, b.input) for b in m.content] == [
        ("tool_use", "get_weather", {"city": "Paris"})]
    with ant.messages.stream(model="m", max_tokens=200, tools=ANTHROPIC_TOOLS,
                             tool_choice={"type": "tool", "name": "get_weather"},
                             messages=[{"role": "user", "content": "FORCE:named"}]) as s:
        final = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", {"city": "Oslo"})]


def test_tool_choice_forces_the_call_responses(server):
    oai, _ = clients(server)
    r = oai.responses.create(model="m", max_output_tokens=200, tools=RESPONSES_TOOLS, tool_choice="required",
                             input="FORCE:required")
    assert [(i.type, i.name, json.loads(i.arguments)) for i in r.output] == [
        ("function_call", "get_weather", {"city": "Paris"})]
    with oai.responses.stream(model="m", max_output_tokens=200, tools=RESPONSES_TOOLS, input="FORCE:named",
                              tool_choice={"type": "function", "name": "get_weather"}) as s:
        final = s.get_final_response()
    assert server.hook.prompts[-1].endswith('<tool_call>\n{"name": "get_weather", "arguments":')
    assert [(i.type, i.name, json.loads(i.arguments)) for i in final.output] == [
        ("function_call", "get_weather", {"city": "Oslo"})]


@pytest.mark.slow
def test_forced_call_skips_the_open_think_block(qwen35):
    oai, ant = clients(qwen35)
    r = oai.chat.completions.create(model="m", max_tokens=200, tools=TOOLS, tool_choice="required",
                                    messages=[{"role": "user", "content": "FORCE:required"}])
    assert qwen35.hook.prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n")
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    m = ant.messages.create(model="m", max_tokens=200, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"},
                            thinking={"type": "enabled", "budget_tokens": 2}, messages=[
                                {"role": "user", "content": "FORCE:required"}])
    assert [b.type for b in m.content] == ["tool_use"] and m.content[0].input == {"city": "Paris"}
