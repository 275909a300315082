"""A call the model opens itself, held to the tools' grammar: `serve --constrain-tool-calls`
(every call) and OpenAI's `strict: true` (that function's arguments, forced or not). Text
outside calls stays the model's own; a call is held from the token after the model's
`<tool_call>` to its `</tool_call>`, in the model's call syntax, arguments matching the
schema; decoding stays exact under MTP (the same output as mlx-lm's greedy decoding under
the same processors, at every depth and acceptance length).

The random fixture model never opens a call by itself, and the demo model (fine-tuned on
Edit calls) opens one whenever tools are offered, so test processors choose: one writes the
`<tool_call>` token at chosen places (the 3rd token, and after the first call's
`</tool_call>` to open a second), another bans it (free text): everything else is the
model's, held."""

import json

import anthropic
import llguidance
import mlx.core as mx
import openai
import pytest
from engine_helpers import loaded, oracle_hook, prompt_of, suffix_drafted_after
from mlx_lm.generate import generate_step
from server_helpers import ServerThread, served_engine
from test_tool_grammar import PARAMS, TOOLS, valid

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.server import call_hold, structured_output, tool_grammar
from mlxmtp.server.tool_parsers import parse_tool_call

STRICT = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}, TOOLS[1]]


def _forced_token(logits, token):
    row = mx.where(mx.arange(logits.shape[-1]) == token, 0.0, -1e9).astype(logits.dtype)
    return mx.broadcast_to(row, logits.shape)


def opener(prompt_len: int, trigger: int, end: int, calls: int = 2):
    """A processor writing `<tool_call>` as the output's 3rd token and after each call's
    `</tool_call>` until `calls` calls were opened; the model's logits elsewhere."""

    def proc(ctx, logits):
        gen = ctx[prompt_len:].tolist()
        opened = gen.count(trigger)
        if (len(gen) == 2 and not opened) or (gen and gen[-1] == end and opened < calls):
            return _forced_token(logits, trigger)
        return logits

    return proc


def calls_in(tok, ids, trigger, end):
    """The (name, arguments) of every closed call in the output, parsed as the server does."""
    out, i = [], 0
    while trigger in ids[i:]:
        i = ids.index(trigger, i) + 1
        j = ids.index(end, i)
        out.append(parse_tool_call(tok.decode(ids[i:j]), TOOLS))
        i = j + 1
    return [(c["name"], c["arguments"]) for c in out]


@pytest.fixture()
def keep_served():
    """The tokenizer grammars are compiled for (one a process: the demo servers' here) is
    served again after the test."""
    saved = dict(structured_output.SERVED_MODEL)
    yield
    structured_output.SERVED_MODEL.clear()
    structured_output.SERVED_MODEL.update(saved)


@pytest.fixture()
def fixture_served(server_model, keep_served):
    """The fixture tokenizer as the one grammars are compiled for."""
    tok = server_model[1]
    structured_output.serve_tokenizer(tok, 320)
    return tok


def lazy_processor(tok, prompt_len, xml, free=(), in_think=False):
    end = structured_output.added_token(tool_grammar.END)
    trigger = structured_output.added_token("<tool_call>")
    text, _ = tool_grammar.call_grammar(TOOLS, "required", xml, end, lazy=True, free=free)
    grammar = llguidance.LLMatcher.grammar_from_lark(text)
    think = call_hold.think_token_ids(tok)
    return call_hold.call_processor(grammar, prompt_len, [trigger, end, *think], in_think,
                                            (tool_grammar.END,))


# ------------------------------------------------------------------ the grammar and the processor
@pytest.mark.parametrize("xml,free_call", [
    (False, '\n{"name": "clock", "arguments": {"zone": "PST", "extra": [1]}}\n</tool_call>'),
    (True, "\n<function=clock>\n<parameter=zone>\nPST\n</parameter>\n<parameter=x>\n1\n</parameter>\n"
           "</function>\n</tool_call>"),
])
def test_a_lazy_grammar_holds_only_the_tools_it_is_asked_to(fixture_served, xml, free_call):
    tok = fixture_served
    end = structured_output.added_token(tool_grammar.END)

    def takes(text, free):
        grammar, _ = tool_grammar.call_grammar(TOOLS, "required", xml, end, lazy=True, free=free)
        m = structured_output.new_matcher(llguidance.LLMatcher.grammar_from_lark(grammar), (tool_grammar.END,))
        ids = tok.encode(text, add_special_tokens=False)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    # Held: the schema's arguments only; free (a tool not marked strict): any arguments,
    # while the call around them keeps its syntax (a tool's name, its closing).
    assert not takes(free_call, ()) and takes(free_call, {"clock"})
    bad_name = free_call.replace("clock", "clack")
    assert not takes(bad_name, {"clock"})
    held = ('\n{"name": "forecast", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>' if not xml else
            "\n<function=forecast>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "</function>\n</tool_call>")
    assert takes(held, {"clock"}) and not takes(held.replace("Oslo", "Rome"), {"clock"})


def test_under_the_flag_a_schema_it_cannot_hold_leaves_that_tool_free(fixture_served):
    # The client did not ask for it to be held: the request is served, the tool's call kept
    # to the syntax; a strict tool with such a schema is a 400 (test_a_strict_schema_...).
    deep = {"type": "object"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}}
    tools = [TOOLS[0], {"type": "function", "function": {"name": "clock", "parameters": deep}}]
    end = structured_output.added_token(tool_grammar.END)
    _, matcher = call_hold._call_grammar(tools, {}, True, False, end, (tool_grammar.END,))

    def takes(text):
        m = matcher.deep_copy()
        ids = fixture_served.encode(text, add_special_tokens=False)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    assert takes('\n{"name": "clock", "arguments": {"zone": 1}}\n</tool_call>')
    assert not takes('\n{"name": "forecast", "arguments": {"city": "Rome", "days": 3}}\n</tool_call>')


def test_the_processor_holds_calls_only_and_follows_rolled_back_contexts(fixture_served):
    tok = fixture_served
    trigger, end = (structured_output.added_token(t) for t in ("<tool_call>", tool_grammar.END))
    think_start, think_end = call_hold.think_token_ids(tok)
    prompt = prompt_of(7)
    call = tok.encode('\n{"name": "clock", "arguments": {"zone": "UTC"}}\n', add_special_tokens=False) + [end]
    text = tok.encode("Sure. ", add_special_tokens=False)
    proc = lazy_processor(tok, len(prompt), xml=False, in_think=True)
    logits = mx.zeros((1, 320))

    def held(gen):
        out = proc(mx.array(prompt + gen), logits)
        return bool(mx.any(out < -1e30).item())

    assert not held([trigger, 5])  # in the prompt's open think block: free
    assert not held([trigger, 5, think_end])
    assert held([trigger, 5, think_end, trigger])  # the answer's call
    assert held([trigger, 5, think_end, trigger] + call[:3])
    assert not held([trigger, 5, think_end, trigger] + call + text)  # after its </tool_call>: free
    assert held([trigger, 5, think_end, trigger] + call + text + [trigger])  # a second call
    assert not held([trigger, 5, think_end] + text)  # a context rolled back past the calls
    assert held([think_end, trigger, *call[:5]])  # and one that differs from its first token
    # Not in a think block: a <think> as the first token opens one, later it is text.
    proc = lazy_processor(tok, len(prompt), xml=False)
    assert held([trigger]) and not held([think_start, trigger]) and held([5, think_start, trigger])
    # Another rank of a distributed server rebuilds it from its recipe.
    from mlxmtp.distributed.wire import _rebuild

    again = _rebuild(list(proc.recipe))
    assert bool(mx.any(again(mx.array(prompt + [trigger]), logits) < -1e30).item())


# ------------------------------------------------------------------ exact under MTP
def mlx_lm_held(ref, tok, prompt, xml, n=300):
    """mlx-lm's own greedy decoding with the same processors: the ground truth."""
    trigger, end = (structured_output.added_token(t) for t in ("<tool_call>", tool_grammar.END))
    procs = [opener(len(prompt), trigger, end), lazy_processor(tok, len(prompt), xml)]
    out = []
    for t, _ in generate_step(mx.array(prompt), ref, max_tokens=n, logits_processors=procs):
        out.append(int(t))
        if out[-1] in tok.eos_token_ids:
            break
    return out


@pytest.mark.slow
@pytest.mark.parametrize("xml", [False, True])
def test_held_calls_equal_mlx_lm_at_every_depth_and_acceptance_length(fixture_model, fixture_served, xml):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    structured_output.serve_tokenizer(tok, 320)
    trigger, end = (structured_output.added_token(t) for t in ("<tool_call>", tool_grammar.END))
    prompt = prompt_of(19, seed=3)
    want = mlx_lm_held(ref, tok, prompt, xml)
    calls = calls_in(tok, want, trigger, end)
    assert len(calls) == 2 and all(valid(name, args) for name, args in calls), calls
    for k in (0, 2, 4):
        eng = BatchGenerator(model, tok, EngineConfig(num_draft=k))
        procs = [opener(len(prompt), trigger, end), lazy_processor(tok, len(prompt), xml)]
        req = Request(prompt=prompt, max_tokens=300, params=SamplingParams(logits_processors=procs))
        eng.submit(req)
        eng.draft_hook = oracle_hook({req.id: want}, p_correct=0.7, seed=k)  # every acceptance length
        got = []
        while eng.has_work:
            for ev in eng.step():
                got += ev.token_ids
        assert got == want, f"xml={xml} k={k}"


def test_held_calls_drafted_by_the_suffix_equal_mlx_lm(fixture_model, fixture_served):
    """Forced calls of a later request drafted by the suffix drafter from an earlier one's
    (the same tools: the calls' syntax repeats, their arguments differ): exact."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    structured_output.serve_tokenizer(tok, 320)
    trigger, end = (structured_output.added_token(t) for t in ("<tool_call>", tool_grammar.END))
    prompts = [prompt_of(19, seed=3), prompt_of(12, seed=9)]
    runs = suffix_drafted_after(model, tok, prompts, lambda p: [opener(len(p), trigger, end),
                                                                lazy_processor(tok, len(p), False)], 300)
    for p, (got, _) in zip(prompts, runs):
        assert got == mlx_lm_held(ref, tok, p, False)
    stats = runs[1][1]
    assert 0 < stats.accepted < stats.drafted, (stats.accepted, stats.drafted)


# ------------------------------------------------------------------ the demo model through every API
class Opener:
    """request_hook: a request whose text holds OPEN gets `opener`, of two calls with OPEN2
    (room for both: a call of the demo takes 27-60 tokens); one whose text holds SHUT never opens a call."""

    def __init__(self, tok):
        self.trigger = tok.encode("<tool_call>", add_special_tokens=False)[0]
        self.end = tok.encode(tool_grammar.END, add_special_tokens=False)[0]

    def __call__(self, req, body):
        raw = json.dumps(body)
        if "OPEN" in raw:
            req.params.logits_processors.insert(0, opener(len(req.prompt), self.trigger, self.end,
                                                          2 if "OPEN2" in raw else 1))
        if "SHUT" in raw:
            req.params.logits_processors.insert(0, banning(self.trigger))


def banning(token: int):
    """A logits processor that never lets `token` be written."""

    def ban(tokens, logits):
        return mx.where(mx.arange(logits.shape[-1]) == token, -mx.inf, logits)

    return ban


@pytest.fixture(scope="module")
def demo_servers():
    """{name: url} of demo servers: "plain" (no flag), "flag" (--constrain-tool-calls),
    "flag_no_mtp" (the flag, MTP off)."""
    import contextlib

    from mlxmtp.models.load import load
    from mlxmtp.server.app import create_app
    from mlxmtp.server.config import ServerConfig

    model, tok = load(None)
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, flag, mtp in (("plain", False, True), ("flag", True, True), ("flag_no_mtp", True, False)):
            app = create_app(model, tok, ServerConfig(constrain_tool_calls=flag),
                             served_engine(prefix_cache_bytes=64 << 20, enable_mtp=mtp), request_hook=Opener(tok))
            servers[name] = stack.enter_context(ServerThread(app))
        assert servers["flag"].state.mtp_active and not servers["flag_no_mtp"].state.mtp_active
        yield {name: srv.url for name, srv in servers.items()}


def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def chat(url, text, tools, stream=False, max_tokens=96):
    """(content, [(name, arguments)]) of a greedy chat completion."""
    kw = dict(model="m", max_tokens=max_tokens, temperature=0, messages=[{"role": "user", "content": text}],
              tools=tools)
    if not stream:
        msg = oai(url).chat.completions.create(**kw).choices[0].message
        return msg.content, [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
    content, calls = "", {}
    for c in oai(url).chat.completions.create(stream=True, **kw):
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            name, args = calls.get(d.index, ("", ""))
            calls[d.index] = (name + (d.function.name or ""), args + (d.function.arguments or ""))
        content += (c.choices[0].delta.content or "") if c.choices else ""
    return content, [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())]


def responses(url, text, tools, stream=False, max_tokens=96):
    kw = dict(model="m", max_output_tokens=max_tokens, temperature=0, input=text,
              tools=[{"type": "function", **t["function"]} for t in tools])
    if stream:  # free text after the call runs to the limit: the response ends incomplete
        out = [e.item for e in oai(url).responses.create(stream=True, **kw) if e.type == "response.output_item.done"]
    else:
        out = oai(url).responses.create(**kw).output
    return [(i.name, json.loads(i.arguments)) for i in out if i.type == "function_call"]


@pytest.mark.slow
def test_free_text_is_the_same_with_the_flag(demo_servers):
    # No call opened: the flag leaves every distribution as it was.
    plain = chat(demo_servers["plain"], "SHUT What is the weather like?", TOOLS, max_tokens=40)
    assert plain == chat(demo_servers["flag"], "SHUT What is the weather like?", TOOLS, max_tokens=40)
    assert plain[0] and not plain[1]


@pytest.mark.slow
def test_calls_the_model_opens_are_held_with_the_flag(demo_servers):
    # Without the flag the demo writes text after its <tool_call>: no call reaches the client.
    assert chat(demo_servers["plain"], "OPEN weather?", TOOLS)[1] == []
    # Two calls in a turn, text free between them.
    content, calls = chat(demo_servers["flag"], "OPEN2 weather?", TOOLS, max_tokens=160)
    assert len(calls) == 2 and all(valid(n, a) for n, a in calls), calls
    content, calls = chat(demo_servers["flag"], "OPEN weather?", TOOLS, stream=True)
    assert len(calls) == 1 and all(valid(n, a) for n, a in calls), calls
    msg = anthropic.Anthropic(base_url=demo_servers["flag"], api_key="x", max_retries=0, timeout=120).messages.create(
        model="m", max_tokens=96, messages=[{"role": "user", "content": "OPEN weather?"}], extra_body={"temperature": 0},
        tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS])
    calls = [(b.name, b.input) for b in msg.content if b.type == "tool_use"]
    assert len(calls) == 1 and all(valid(n, a) for n, a in calls), calls


@pytest.mark.slow
def test_held_output_is_the_same_with_mtp_on_and_off(demo_servers):
    on = chat(demo_servers["flag"], "OPEN2 weather in Oslo?", TOOLS, max_tokens=160)
    assert len(on[1]) == 2 and on == chat(demo_servers["flag_no_mtp"], "OPEN2 weather in Oslo?", TOOLS, max_tokens=160)


@pytest.mark.slow
def test_strict_tools_are_held_when_the_model_calls_them(demo_servers):
    # No flag, no forcing: a call of the strict function is held to its schema; the other
    # (not strict) to the call's syntax only.
    url = demo_servers["plain"]
    for stream in (False, True):
        for calls in (chat(url, "OPEN weather?", STRICT, stream)[1], responses(url, "OPEN weather?", STRICT, stream)):
            assert len(calls) == 1 and all(isinstance(a, dict) for _, a in calls), (stream, calls)
            assert all(valid(n, a) for n, a in calls if n == "forecast") and any(n == "forecast" for n, _ in calls)


@pytest.mark.slow
def test_a_strict_schema_it_cannot_hold_is_a_400_naming_it(demo_servers):
    bad = {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}}
    strict_bad = {"type": "function", "function": {"name": "bad", "parameters": bad, "strict": True}}
    client = oai(demo_servers["plain"])
    for tools, field in (([TOOLS[0], strict_bad], "tools[1].function.parameters"),
                         ([{"type": "function", "function": {**TOOLS[0]["function"], "strict": "yes"}}],
                          "tools[0].function.strict")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}],
                                           tools=tools)
        assert e.value.body["param"] == field and field in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", max_output_tokens=1, input="x", tools=[
            {"type": "function", "name": "f", "parameters": PARAMS}, {"type": "function", **strict_bad["function"]}])
    assert e.value.body["param"] == "tools[1].parameters" and "not" in e.value.body["message"]
    with pytest.raises(anthropic.BadRequestError) as e:  # Anthropic's strict tool use
        anthropic.Anthropic(base_url=demo_servers["plain"], api_key="x", max_retries=0).messages.create(
            model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}],
            tools=[{"name": "bad", "input_schema": bad, "strict": True}])
    assert "tools.0.input_schema" in e.value.body["error"]["message"]
    # Not strict, the same schema is only shown to the model.
    ok = client.chat.completions.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}],
                                        tools=[{"type": "function", "function": {"name": "bad", "parameters": bad}}])
    assert ok.choices[0].finish_reason == "length"


def test_the_flag_reaches_the_server(tmp_path, keep_served):
    from unittest import mock

    from click.testing import CliRunner

    from mlxmtp.commands.main import main
    from mlxmtp.testing.fixtures import write_hf_checkpoint

    path = write_hf_checkpoint(tmp_path / "m", "qwen3_5")
    for extra, want in (([], False), (["--constrain-tool-calls"], True)):
        with mock.patch("mlxmtp.server.shutdown.run_server") as run:
            res = CliRunner().invoke(main, ["serve", "--model", str(path), "--port", "0", *extra])
        assert res.exit_code == 0, res.output
        assert run.call_args.args[0].state.server.constrain_tool_calls is want
