"""Unit tests on crafted text: tool-call parsers, the streaming think/tool splitter,
message conversion and template rendering (fixture tokenizer), error shapes."""

import json

import pytest

from mlxmtp.server.anthropic_input import anthropic_messages, anthropic_tools, listed_tools
from mlxmtp.server.chat import build_prompt, encode_prompt, place_system, render
from mlxmtp.server.errors import APIError, anthropic_error_body, openai_error_body
from mlxmtp.server.openai_input import openai_messages
from mlxmtp.server.reasoning import OutputSplitter, split_all, starts_in_thinking
from mlxmtp.server.tool_parsers import ToolParseError, parse_tool_call
from mlxmtp.server.validation import field, parse_json_body

TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "force": {"type": "boolean"},
    "opts": {"type": "object"}, "code": {"type": "string"}}}}}]


# ------------------------------------------------------------------ tool parsers
def test_hermes_json_tool_call():
    assert parse_tool_call('\n{"name": "f", "arguments": {"a": 1, "b": "x"}}\n') == \
        {"name": "f", "arguments": {"a": 1, "b": "x"}}
    # double-encoded arguments and "parameters" spelling
    assert parse_tool_call('{"name": "f", "arguments": "{\\"a\\": 2}"}')["arguments"] == {"a": 2}
    assert parse_tool_call('{"name": "f", "parameters": {"q": true}}')["arguments"] == {"q": True}
    assert parse_tool_call('{"name": "f"}')["arguments"] == {}


def test_qwen3_coder_xml_tool_call_typed_by_schema():
    body = ("\n<function=edit>\n<parameter=path>\nsrc/a.py\n</parameter>\n<parameter=line>\n42\n</parameter>\n"
            "<parameter=force>\ntrue\n</parameter>\n<parameter=opts>\n{\"x\": [1, 2]}\n</parameter>\n"
            "<parameter=code>\ndef f():\n    return 1\n</parameter>\n</function>\n")
    call = parse_tool_call(body, TOOLS)
    assert call == {"name": "edit", "arguments": {"path": "src/a.py", "line": 42, "force": True,
                                                  "opts": {"x": [1, 2]}, "code": "def f():\n    return 1"}}
    # Without a schema, scalars stay strings; structured values decode.
    assert parse_tool_call("<function=g><parameter=n>7</parameter><parameter=o>[1]</parameter></function>") == \
        {"name": "g", "arguments": {"n": "7", "o": [1]}}


@pytest.mark.parametrize("bad", ["", "not json", '{"arguments": {}}', '{"name": "f", "arguments": [1]}',
                                 "<function>oops"])
def test_tool_call_parse_errors(bad):
    with pytest.raises(ToolParseError):
        parse_tool_call(bad)


DEEP = "[" * 3000 + "]" * 3000  # json.loads: RecursionError
NESTED = "[" * 200 + "]" * 200  # parses, but deeper than a reply may hold


@pytest.mark.parametrize("body", [
    '{"name": "f", "arguments": {"a": %s}}' % DEEP, '{"name": "f", "arguments": {"a": %s}}' % NESTED,
    '{"name": "f", "arguments": "{\\"a\\": %s}"}' % DEEP,
    "<function=f><parameter=a>%s</parameter></function>" % DEEP,
    "<function=f><parameter=a>%s</parameter></function>" % NESTED])
def test_a_call_nested_too_deeply_is_no_call_and_stays_text(body):
    # The model's own output: a call that no JSON reply could hold is returned as text,
    # never a 500 or a cut stream.
    with pytest.raises(ToolParseError, match="nested"):
        parse_tool_call(body)
    out = _stream("<tool_call>\n" + body + "\n</tool_call>")
    assert [k for k, _ in out] == ["content"] * len(out) and "".join(v for _, v in out).count("[") >= 200
    json.dumps(out)


@pytest.mark.parametrize("schema", [{"properties": "bad"}, {"properties": {"a": "integer"}}, [1], "x",
                                    {"properties": {"a": True}}, {"properties": {"a": {"type": ["integer", "null"]}}}])
def test_an_xml_call_parses_whatever_schema_its_tool_has(schema):
    # The parser reads each parameter's type from the tool's schema; a schema it cannot
    # read types nothing (validation refuses most of these before generation anyway).
    call = "<function=f>\n<parameter=a>\n1\n</parameter>\n</function>"
    for tools in ([{"type": "function", "function": {"name": "f", "parameters": schema}}],
                  [{"name": "f", "input_schema": schema}]):
        assert parse_tool_call(call, tools)["arguments"]["a"] in ("1", 1)


def test_a_template_s_refusal_names_the_api_s_own_field():
    class Refusing:
        chat_template = "{{ raise_exception('no') }}"

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("no")

    for param in ("messages", "input"):
        with pytest.raises(APIError) as e:
            build_prompt(Refusing(), [{"role": "user", "content": "x"}], param=param)
        assert e.value.status == 400 and e.value.param == param


# ------------------------------------------------------------------ splitter
def _stream(text, **kw):
    sp = OutputSplitter(**kw)
    out = []
    for ch in text:  # worst case: one character per event, tags split everywhere
        out += sp.feed(ch)
    out += sp.finish()
    merged = []
    for kind, value in out:
        if merged and merged[-1][0] == kind and kind != "tool_call":
            merged[-1] = (kind, merged[-1][1] + value)
        else:
            merged.append((kind, value))
    return merged


@pytest.mark.parametrize("chunked", [False, True])
def test_splitter_think_then_content_then_tools(chunked):
    text = ('<think>\nplan it\n</think>\n\nI will call two tools.\n\n<tool_call>\n{"name": "f", "arguments": '
            '{"a": 1}}\n</tool_call>\n<tool_call>\n<function=edit>\n<parameter=line>\n3\n</parameter>\n'
            '</function>\n</tool_call>')
    out = _stream(text, tools=TOOLS) if chunked else split_all(text, tools=TOOLS)
    assert out == [("reasoning", "plan it"), ("content", "I will call two tools."),
                   ("tool_call", {"name": "f", "arguments": {"a": 1}}),
                   ("tool_call", {"name": "edit", "arguments": {"line": 3}})]


def test_splitter_starts_inside_thinking():
    out = _stream("let me think\n</think>\n\nAnswer: 4", in_thinking=True)
    assert out == [("reasoning", "let me think"), ("content", "Answer: 4")]
    # Thinking never closed (max_tokens): everything is reasoning, nothing leaks into content.
    assert _stream("still thinking <tool", in_thinking=True) == [("reasoning", "still thinking <tool")]


def test_splitter_tools_not_parsed_without_tools_and_bad_calls_kept():
    text = 'a <tool_call>{"name": "f"}</tool_call> b'
    assert _stream(text, parse_tools=False) == [("content", text)]
    out = _stream("x <tool_call>garbage</tool_call> y")
    assert "".join(v for k, v in out if k == "content").replace(" ", "") == "x<tool_call>garbage</tool_call>y"
    # Unterminated but complete call at EOS is still a call.
    assert _stream('<tool_call>\n{"name": "f", "arguments": {}}')[-1] == ("tool_call", {"name": "f", "arguments": {}})


def test_think_tags_after_the_answer_are_text():
    assert _stream("<think>a</think>Use <think> tags.") == [("reasoning", "a"), ("content", "Use <think> tags.")]


def test_splitter_holds_partial_tags_only():
    sp = OutputSplitter()
    assert sp.feed("Hello <thi") == [("content", "Hello ")]
    assert sp.feed("s is fine") == [("content", "<this is fine")]
    assert sp.feed("<") == []
    assert sp.finish() == [("content", "<")]


@pytest.mark.parametrize("chunked", [False, True])
def test_the_splitter_drops_the_templates_newlines_and_never_a_space(chunked):
    def run(text, **kw):
        return _stream(text, **kw) if chunked else split_all(text, **kw)

    # Code whose first line is indented keeps its indentation; trailing spaces (text cut
    # by a stop string) stay too.
    assert run("    return x\n") == [("content", "    return x\n")]
    assert run("import ") == [("content", "import ")]
    # The newlines the templates put around <think> and before <tool_call> go.
    assert run("<think>\nhmm\n</think>\n\n  indented") == [("reasoning", "hmm"), ("content", "  indented")]
    assert run("reason\n</think>\n\nok", in_thinking=True) == [("reasoning", "reason"), ("content", "ok")]
    out = run('see:\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', tools=TOOLS)
    assert out == [("content", "see:"), ("tool_call", {"name": "f", "arguments": {}})]


def test_starts_in_thinking():
    assert starts_in_thinking("<|im_start|>assistant\n<think>\n")
    assert not starts_in_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_in_thinking("<|im_start|>assistant\n")


# ------------------------------------------------------------------ messages
def test_openai_messages_conversion():
    msgs = openai_messages([
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ])
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1]["content"] == "hi there"
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1}  # dict for the template
    assert msgs[3] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    # A picture (aider's /add shot.png) becomes a note: the models served read text only.
    seen = openai_messages([{"role": "user", "content": [
        {"type": "text", "text": "what is this? "}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,x"}}]}])
    assert seen[0]["content"] == "what is this? [image_url omitted: this server reads text only]"
    for bad in ([], "x", [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 5}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                [{"role": "user", "content": [{"type": "video", "video": {}}]}]):
        with pytest.raises(APIError) as e:
            openai_messages(bad)
        assert e.value.status == 400


def test_anthropic_messages_conversion():
    msgs = anthropic_messages([{"type": "text", "text": "sys"}], [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                          {"type": "text", "text": "checking"},
                                          {"type": "tool_use", "id": "t1", "name": "w", "input": {"c": "P"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "sunny"}]}, {"type": "text", "text": "thanks"}]},
    ])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "user"]
    assert msgs[2]["reasoning_content"] == "hmm"
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "w", "arguments": {"c": "P"}}
    assert msgs[3]["content"] == "sunny"
    tools = anthropic_tools([{"name": "w", "description": "d", "input_schema": {"type": "object"}}])
    assert tools == [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"},
                                                       "description": "d"}}]


def _search_tools(loaded=()):
    """Claude Code's tools under tool search: listed ones, a placeholder and the tools it has
    loaded, all but the listed marked defer_loading, the loaded ones in name order."""
    schema = {"type": "object", "properties": {"url": {"type": "string"}}}
    names = sorted(["Bash", "Read", "ToolSearch", *loaded])
    tools = [dict({"name": n, "description": f"{n} tool.", "input_schema": schema},
                  **({"defer_loading": True} if n in loaded else {})) for n in names]
    return tools + [{"name": "DeferredToolPlaceholder", "description": "Never call it.",
                     "input_schema": {"type": "object", "properties": {}}, "defer_loading": True}]


def test_deferred_tools_are_not_listed_and_a_tool_reference_loads_one():
    raw = _search_tools(loaded=["WebFetch"])
    functions = anthropic_tools(raw)
    assert [t["function"]["name"] for t in listed_tools(raw, functions)] == ["Bash", "Read", "ToolSearch"]
    assert len(functions) == 5  # calls to a deferred tool still parse
    msgs = anthropic_messages(None, [
        {"role": "user", "content": "fetch it"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                           "input": {"query": "select:WebFetch"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "tool_reference", "tool_name": "WebFetch"}]}, {"type": "text", "text": "Tool loaded."}]},
    ], functions)
    schema = {"description": "WebFetch tool.", "name": "WebFetch",
              "parameters": {"type": "object", "properties": {"url": {"type": "string"}}}}
    assert msgs[2] == {"role": "tool", "tool_call_id": "t1",
                       "content": f"<functions>\n<function>{json.dumps(schema)}</function>\n</functions>"}
    mixed = anthropic_messages(None, [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                                   "content": [{"type": "text", "text": "found:"},
                                                                               {"type": "tool_reference",
                                                                                "tool_name": "WebFetch"},
                                                                               {"type": "text", "text": "end"}]}]}],
                               functions)
    assert mixed[0]["content"] == f"found:\n<functions>\n<function>{json.dumps(schema)}</function>\n</functions>\nend"
    only_deferred = [dict(t, defer_loading=True) for t in raw]
    assert listed_tools(only_deferred, anthropic_tools(only_deferred)) == anthropic_tools(only_deferred)
    for ref, says in (({"type": "tool_reference", "tool_name": "Gone"}, "tool reference 'Gone' not found"),
                      ({"type": "tool_reference"}, "need a 'tool_name'")):
        with pytest.raises(APIError) as e:
            anthropic_messages(None, [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [ref]}]}], functions)
        assert e.value.status == 400 and says in e.value.message and "messages.0" in e.value.message


def test_loading_a_deferred_tool_keeps_the_prompt_before_it(tmp_path):
    """Claude Code after ToolSearch: the loaded tool joins `tools` mid-list and a tool_reference
    names it. The prompt up to the new turn is the one before, token for token (its cached
    prefix holds), and the schema is in the tool's result."""
    from mlx_lm.tokenizer_utils import load as load_tok

    from mlxmtp.testing.fixtures import write_tokenizer

    write_tokenizer(tmp_path)
    tok = load_tok(tmp_path)
    first = [{"role": "user", "content": "fetch example.org"}]
    after = first + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                           "input": {"query": "select:WebFetch"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "tool_reference", "tool_name": "WebFetch"}]}]}]
    prompts = []
    for raw, msgs in ((_search_tools(), first), (_search_tools(loaded=["WebFetch"]), after)):
        functions = anthropic_tools(raw)
        prompts.append(build_prompt(tok, anthropic_messages("sys", msgs, functions),
                                    listed_tools(raw, functions), enable_thinking=False))
    turn = prompts[0].text.rindex("<|im_start|>assistant")
    assert prompts[1].text[:turn] == prompts[0].text[:turn]
    assert '"name": "WebFetch"' not in prompts[1].text[:turn]
    assert '<function>{"description": "WebFetch tool.", "name": "WebFetch"' in prompts[1].text[turn:]


def test_render_with_fixture_template(tmp_path):
    from mlx_lm.tokenizer_utils import load as load_tok

    from mlxmtp.testing.fixtures import write_tokenizer

    write_tokenizer(tmp_path)
    tok = load_tok(tmp_path)
    msgs = openai_messages([
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ])
    tools = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
    ids, text, in_think = render(tok, msgs, tools, enable_thinking=False)
    assert "<tools>" in text and '"name": "w"' in text
    assert '<tool_call>\n{"name": "w", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<think>\n\n</think>\n\n") and not in_think
    assert tok.decode(ids) == text
    _, text_on, _ = render(tok, msgs, None, enable_thinking=True)
    assert "<tools>" not in text_on and not text_on.endswith("</think>\n\n")
    assert encode_prompt(tok, "abc") == tok.encode("abc", add_special_tokens=False)
    assert encode_prompt(tok, [[1, 2, 3]]) == [1, 2, 3]


def test_place_system_folds_where_the_template_refuses():
    class Strict:  # a template that takes a system message only first (Qwen3.5/3.6)
        chat_template = "strict"

        def apply_chat_template(self, messages, **kw):
            if any(m["role"] == "system" for m in messages[1:]):
                raise ValueError("System message must be at the beginning.")
            return "".join(m["content"] for m in messages)

    sys_, user, asst = ({"role": r, "content": c} for r, c in (("system", "S"), ("user", "u"), ("assistant", "a")))
    note = {"role": "system", "content": "N"}
    tool = {"role": "tool", "content": "t"}
    assert place_system(Strict(), [sys_, dict(sys_, content="T"), user]) == [
        {"role": "system", "content": "S\n\nT"}, user]
    # Into the next user turn, after tool results; its own user turn before an assistant turn or at the end.
    assert place_system(Strict(), [sys_, user, asst, note, tool, user]) == [
        sys_, user, asst, tool, {"role": "user", "content": "[System]\nN\n\nu"}]
    assert place_system(Strict(), [user, note, asst, note]) == [
        user, {"role": "user", "content": "[System]\nN"}, asst, {"role": "user", "content": "[System]\nN"}]

    class Renders(Strict):  # Qwen3's templates render a later system turn: kept
        chat_template = "renders"

        def apply_chat_template(self, messages, **kw):
            return "".join(m["content"] for m in messages)

    assert place_system(Renders(), [user, asst, note, user]) == [user, asst, note, user]


# ------------------------------------------------------------------ errors
def test_error_shapes_and_field_checks():
    err = APIError(404, "nope", param="model", code="model_not_found")
    assert openai_error_body(err) == {"error": {"message": "nope", "type": "invalid_request_error",
                                                "param": "model", "code": "model_not_found"}}
    assert anthropic_error_body(err) == {"type": "error", "error": {"type": "not_found_error", "message": "nope"}}
    with pytest.raises(APIError):
        parse_json_body(b"{oops")
    with pytest.raises(APIError):
        parse_json_body(json.dumps([1]).encode())
    assert field({"t": 1}, "t", float) == 1
    for body in ({"t": True}, {"t": "1"}, {"t": -1}):
        with pytest.raises(APIError):
            field(body, "t", float, minimum=0)
