"""A forced tool call (tool_choice required / a named function; Anthropic's any / tool) is
held to a grammar of the model's own call syntax around the tool's JSON schema: the client
always gets a call that parses, with arguments that match the schema, whatever the model
would have written (the demo model and a random fixture model wrote text before)."""

import json

import anthropic
import llguidance
import openai
import pytest
from server_helpers import ServerThread, served_engine

from mlxmtp.server import structured_output, tool_grammar
from mlxmtp.server.app import create_app

PARAMS = {"type": "object", "required": ["city", "days"], "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "note": {"type": "string", "maxLength": 12}}}
TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {
             "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]


def valid(name, args) -> bool:
    if name == "clock":
        return set(args) == {"zone"} and args["zone"] in ("UTC", "CET")
    return (name == "forecast" and {"city", "days"} <= set(args) <= {"city", "days", "note"}
            and args["city"] in ("Paris", "Oslo", "Lima") and isinstance(args["days"], int)
            and 1 <= args["days"] <= 7 and len(args.get("note", "")) <= 12)


# ------------------------------------------------------------------ the grammar itself
@pytest.fixture(scope="module")
def fixture_tok(server_model):
    return server_model[1]


def matcher(tok, forced, xml):
    structured_output.serve_tokenizer(tok, 320)
    end = structured_output.added_token(tool_grammar.END)
    text, _ = tool_grammar.call_grammar(TOOLS, forced, xml, end)
    return structured_output.new_matcher(llguidance.LLMatcher.grammar_from_lark(text), (tool_grammar.END,))


@pytest.mark.parametrize("xml,forced,good,bad", [
    (False, "required", '{"name": "forecast", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>',
     '{"name": "forecast", "arguments": {"city": "Rome", "days": 3}}\n</tool_call>'),
    (False, "forecast", ' {"city": "Lima", "days": 2, "note": "bring a hat"}}\n</tool_call>',  # schema order
     ' {"city": "Lima", "days": 9}}\n</tool_call>'),
    (True, "required", "clock>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>",
     "clock>\n<parameter=zone>\nPST\n</parameter>\n</function>\n</tool_call>"),
    (True, "forecast", "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n4\n</parameter>\n"
                       "<parameter=note>\na < b </x>\n</parameter>\n</function>\n</tool_call>",
     "<parameter=days>\n4\n</parameter>\n</function>\n</tool_call>"),  # a required parameter left out
])
def test_the_grammar_takes_calls_of_the_schema_and_refuses_others(fixture_tok, xml, forced, good, bad):
    ids = fixture_tok.encode(good, add_special_tokens=False)
    m = matcher(fixture_tok, forced, xml)
    assert m.try_consume_tokens(ids) == len(ids) and m.is_accepting()
    ids = fixture_tok.encode(bad, add_special_tokens=False)
    m = matcher(fixture_tok, forced, xml)
    assert m.try_consume_tokens(ids) < len(ids)


def test_a_function_without_parameters_is_called_with_none(fixture_tok):
    """OpenAI: a function defined without `parameters` has an empty parameter list."""
    structured_output.serve_tokenizer(fixture_tok, 320)
    end = structured_output.added_token(tool_grammar.END)
    tools = [{"type": "function", "function": {"name": "get_goal", "description": "Read the goal."}}]
    text, _ = tool_grammar.call_grammar(tools, "required", False, end)
    for call, whole in (('{"name": "get_goal", "arguments": {}}\n</tool_call>', True),
                        ('{"name": "get_goal", "arguments": {"x": 1}}\n</tool_call>', False)):
        m = structured_output.new_matcher(llguidance.LLMatcher.grammar_from_lark(text), (tool_grammar.END,))
        ids = fixture_tok.encode(call, add_special_tokens=False)
        assert (m.try_consume_tokens(ids) == len(ids) and m.is_accepting()) == whole, call


# ------------------------------------------------------------------ every API, a model left to itself
def calls_of(api, client, forced, stream):
    """(name, arguments) of the calls a forced request returned, through each API's SDK."""
    user = [{"role": "user", "content": "What is the weather like?"}]
    if api == "chat":
        choice = "required" if forced == "required" else {"type": "function", "function": {"name": forced}}
        kw = dict(model="m", max_tokens=120, temperature=0, messages=user, tools=TOOLS, tool_choice=choice)
        if not stream:
            return [(c.function.name, json.loads(c.function.arguments))
                    for c in client.chat.completions.create(**kw).choices[0].message.tool_calls]
        deltas = [tc for c in client.chat.completions.create(stream=True, **kw) if c.choices
                  for tc in c.choices[0].delta.tool_calls or []]
        return [(deltas[0].function.name, json.loads("".join(d.function.arguments or "" for d in deltas)))]
    if api == "responses":
        tools = [{"type": "function", **t["function"]} for t in TOOLS]
        choice = "required" if forced == "required" else {"type": "function", "name": forced}
        kw = dict(model="m", max_output_tokens=120, temperature=0, input="What is the weather like?", tools=tools,
                  tool_choice=choice)
        if stream:
            with client.responses.stream(**kw) as s:
                out = s.get_final_response().output
        else:
            out = client.responses.create(**kw).output
        return [(i.name, json.loads(i.arguments)) for i in out if i.type == "function_call"]
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    choice = {"type": "any"} if forced == "required" else {"type": "tool", "name": forced}
    kw = dict(model="m", max_tokens=120, messages=user, tools=tools, tool_choice=choice,
              extra_body={"temperature": 0})
    if stream:
        with client.messages.stream(**kw) as s:
            content = s.get_final_message().content
    else:
        content = client.messages.create(**kw).content
    return [(b.name, b.input) for b in content if b.type == "tool_use"]


def every_forced_call(url, every: bool):
    """Forced calls through each API, streaming and not; `every`: each with either kind of
    forcing (else one kind each, alternating)."""
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    ant = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
    n = 0
    for api, client in (("chat", oai), ("responses", oai), ("messages", ant)):
        for stream in (False, True):
            for forced in ("required", "forecast") if every else [("required", "forecast")[n % 2]]:
                calls = calls_of(api, client, forced, stream)
                assert calls and all(valid(n, a) for n, a in calls), (api, forced, stream, calls)
                assert forced == "required" or calls[0][0] == forced
            n += 1


@pytest.mark.slow
def test_forced_calls_of_the_demo_model_are_calls_of_the_schema():
    # The demo writes Python-like text; forced, it wrote that text after `<tool_call>`.
    from mlxmtp.models.load import load

    model, tok = load(None)
    with ServerThread(create_app(model, tok, engine=served_engine(prefix_cache_bytes=64 << 20))) as srv:  # the tools' prompt once
        every_forced_call(srv.url, every=False)


@pytest.mark.slow
def test_forced_calls_in_qwen3_coder_syntax_are_calls_of_the_schema(server_model):
    # A random model, its template writing calls as <function=...>: XML held to the schema.
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    model, tok = server_model
    xml_tok = TokenizerWrapper(tok._tokenizer)
    xml_tok._tokenizer = type(tok._tokenizer).from_pretrained(tok._tokenizer.name_or_path)
    xml_tok._tokenizer.chat_template = tok._tokenizer.chat_template + "{#- calls: <function=NAME> #}"
    assert tool_grammar.is_xml(xml_tok)
    with ServerThread(create_app(model, xml_tok, engine=served_engine(prefix_cache_bytes=64 << 20))) as srv:
        every_forced_call(srv.url, every=True)
