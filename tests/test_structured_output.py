"""Structured output: an answer held to a JSON schema (llguidance's grammar as a logits
processor) is exactly what mlx-lm's own decoding writes under the same constraint, at every
MTP depth and acceptance length, and valid against the schema; each API's format field.

The fixture model is random: held to a schema it still writes valid JSON (every token is
chosen among those the grammar allows), which is what is checked, not its content."""

import json
import math
import threading

import mlx.core as mx
import pytest
from engine_helpers import loaded, oracle_hook, prompt_of, suffix_drafted_after
from mlx_lm.generate import generate_step
from server_helpers import served_engine

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.server.structured_output import grammar_for, grammar_processor, serve_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "ok", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}


def valid(obj) -> bool:
    """What SCHEMA asks of an answer."""
    return (isinstance(obj, dict) and set(obj) == {"name", "n", "ok", "tags"} and isinstance(obj["name"], str)
            and len(obj["name"]) <= 6 and isinstance(obj["n"], int) and obj["n"] >= 0 and isinstance(obj["ok"], bool)
            and isinstance(obj["tags"], list) and len(obj["tags"]) <= 2 and set(obj["tags"]) <= {"a", "b"})


def held(tok, prompt):
    serve_tokenizer(tok, 320)
    return grammar_processor(grammar_for(SCHEMA, "test"), len(prompt))


def mlx_lm_held(ref, tok, prompt, n=600):
    """mlx-lm's own greedy decoding with the processor: the ground truth."""
    out = []
    for t, _ in generate_step(mx.array(prompt), ref, max_tokens=n, logits_processors=[held(tok, prompt)]):
        out.append(int(t))
        if out[-1] in tok.eos_token_ids:
            break
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_6_moe"])
def test_held_output_equals_mlx_lm_at_every_depth_and_acceptance_length(fixture_model, family):
    model, tok, ref = loaded(str(fixture_model(family)["hf"]))
    prompt = prompt_of(23, seed=5)
    want = mlx_lm_held(ref, tok, prompt)
    assert want[-1] in tok.eos_token_ids and valid(json.loads(tok.decode(want[:-1])))
    for k in (0, 1, 2, 4):
        eng = BatchGenerator(model, tok, EngineConfig(num_draft=k))
        req = Request(prompt=prompt, max_tokens=600, params=SamplingParams(logits_processors=[held(tok, prompt)]))
        eng.submit(req)
        # Drafts right with p = 0.7: every acceptance length occurs, so the matcher rolls
        # back rejected drafts at every depth.
        eng.draft_hook = oracle_hook({req.id: want}, p_correct=0.7, seed=k)
        got = []
        while eng.has_work:
            for ev in eng.step():
                got += ev.token_ids
        assert got == want, f"{family} k={k}"


def test_held_output_drafted_by_the_suffix_equals_mlx_lm(fixture_model):
    """Suffix drafts (model-free: nothing masks them before the verify) of a later answer
    held to the schema, read off an earlier one: the grammar keeps the drafts it allows and
    rejects the rest, and the text is mlx-lm's own."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    prompts = [prompt_of(23, seed=5), prompt_of(17, seed=8)]
    runs = suffix_drafted_after(model, tok, prompts, lambda p: [held(tok, p)], 600)
    for p, (got, _) in zip(prompts, runs):
        assert got == mlx_lm_held(ref, tok, p)
    stats = runs[1][1]
    assert 0 < stats.accepted < stats.drafted, (stats.accepted, stats.drafted)


@pytest.mark.slow
def test_sampled_held_output_is_valid_at_every_depth(fixture_model):
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    for k in (0, 3):
        for seed in range(3):
            prompt = prompt_of(9, seed=seed)
            params = SamplingParams(temperature=1.0, seed=seed, logits_processors=[held(tok, prompt)])
            eng = BatchGenerator(model, tok, EngineConfig(num_draft=k))
            eng.submit(Request(prompt=prompt, max_tokens=600, params=params))
            got = []
            while eng.has_work:
                for ev in eng.step():
                    got += ev.token_ids
            assert got[-1] in tok.eos_token_ids and valid(json.loads(tok.decode(got[:-1]))), (k, seed)


# ------------------------------------------------------------------ the APIs' format fields
@pytest.fixture(scope="module")
def server(start_server):
    return start_server(engine=served_engine(max_batch=4))


@pytest.mark.slow
def test_every_api_holds_its_answer_to_the_schema(server, oai, ant):
    chat = oai.chat.completions.create(model="m", max_tokens=600, temperature=0, messages=[
        {"role": "user", "content": "Describe it."}],
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}})
    assert chat.choices[0].finish_reason == "stop" and valid(json.loads(chat.choices[0].message.content))
    # Any object: a random model may not close one within the tokens it is given.
    obj = oai.chat.completions.create(model="m", max_tokens=40, temperature=0, response_format={"type": "json_object"},
                                      messages=[{"role": "user", "content": "Any object."}]).choices[0]
    assert obj.message.content.startswith("{")
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.message.content), dict)
    resp = oai.responses.create(model="m", input="Describe it.", max_output_tokens=600, temperature=0,
                                text={"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA}})
    assert resp.status == "completed" and valid(json.loads(resp.output_text))
    msg = ant.messages.create(model="m", max_tokens=600, messages=[{"role": "user", "content": "Describe it."}],
                              extra_body={"temperature": 0, "output_config": {
                                  "format": {"type": "json_schema", "schema": SCHEMA}}})
    assert msg.stop_reason == "end_turn" and valid(json.loads(msg.content[0].text))


def test_held_text_may_spell_special_tokens_and_logprobs_stay_finite(server, oai):
    # "<think>" is one special token of Qwen's vocabulary; in held text it is spelt out,
    # and the schema holds to the end. Tokens the grammar refused are not among the top
    # logprobs (their -inf is not JSON).
    for stream in (False, True):
        kw = dict(model="m", max_tokens=60, temperature=0, logprobs=True, top_logprobs=5, stream=stream,
                  messages=[{"role": "user", "content": "x"}],
                  response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": {"const": "<think>b"}}})
        if stream:
            chunks = [c.choices[0] for c in oai.chat.completions.create(**kw) if c.choices]
            text = "".join(c.delta.content or "" for c in chunks)
            lps = [e for c in chunks if c.logprobs for e in c.logprobs.content]
        else:
            r = oai.chat.completions.create(**kw).choices[0]
            text, lps = r.message.content, r.logprobs.content
        assert json.loads(text) == "<think>b"
        assert lps and all(math.isfinite(e.logprob) and all(math.isfinite(t.logprob) for t in e.top_logprobs)
                           for e in lps)


def test_a_schema_it_cannot_enforce_and_a_forced_call_are_400s(server):
    import httpx

    for path, body, param in [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": "x"}},
         "response_format.json_schema"),
        ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        ("/v1/messages", {"max_tokens": 4, "output_config": "x"}, "output_config"),
        ("/v1/messages", {"max_tokens": 4, "output_config": {"format": {"type": "json_schema"}}},
         "output_config.format.schema"),
    ]:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **body}
        r = httpx.post(server.url + path, timeout=30, json=body)
        assert r.status_code == 400 and param in r.text, (path, r.text)

    for schema, message in [({"type": "nonsense"}, "nonsense"),
                            # known keywords llguidance does not enforce: dropped, they could be broken
                            ({"not": {"type": "null"}}, "cannot enforce: not"),
                            ({"type": "array", "uniqueItems": True, "if": {}}, "cannot enforce: if, uniqueItems"),
                            ({"$ref": "#"}, "no JSON value satisfies this schema"),  # answered "" before
                            ({"type": "object", "const": 1}, "Unsatisfiable")]:
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "response_format": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
        assert message in r.json()["error"]["message"], r.text
    # Keywords that constrain nothing are no reason to refuse; a property named like one is a property.
    for schema in [{"type": "array", "uniqueItems": False},
                   {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {"type": "string"}},
                   {"type": "object", "properties": {"uniqueItems": {"type": "boolean"}, "not": {"type": "string"}}}]:
        ok = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "response_format": ok})
        assert r.status_code == 200, (schema, r.text)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "tools": tools,
        "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "forced to call a tool" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/responses", timeout=30, json={
        "model": "m", "input": "x", "text": {"format": {"type": "yaml"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.type"


def _wide(n: int) -> dict:
    """An object of n optional string properties (500 pass the bounds; llguidance's Earley row
    of its first key then holds ~2000 items, its limit)."""
    return {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(n)}}


def test_schemas_too_wide_for_the_grammar_are_400s_naming_their_field(server):
    import httpx

    user, fmt = [{"role": "user", "content": "x"}], {"type": "json_schema"}
    for path, body, field in [
        ("/v1/chat/completions", {"messages": user, "response_format": {**fmt, "json_schema": {
            "name": "w", "schema": _wide(500)}}}, "response_format"),
        ("/v1/responses", {"input": "x", "text": {"format": {**fmt, "name": "w", "schema": _wide(500)}}}, "text.format"),
        ("/v1/messages", {"messages": user, "output_config": {"format": {**fmt, "schema": _wide(500)}}},
         "output_config.format"),
        # a forced call whose required property holds its own object forces tokens without end
        ("/v1/chat/completions", {"messages": user, "tool_choice": "required", "tools": [{
            "type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}]}, "tools"),
    ]:
        r = httpx.post(server.url + path, timeout=60, json={"model": "m", "max_tokens": 8, **body})
        assert r.status_code == 400 and field in r.text, (path, r.text)
    ok = {**fmt, "json_schema": {"name": "w", "schema": _wide(400)}}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "m", "max_tokens": 8, "messages": user, "response_format": ok})
    assert r.status_code == 200, r.text


def test_an_answer_its_schema_stops_holding_part_way_is_a_400_naming_the_field(start_server):
    # The wide object comes after a string of 12 characters: past the tokens compile_schema walks,
    # so the grammar meets its limit in the answer (grammar_mask.GrammarError), which the
    # scripted model writes as the schema asks.
    import httpx

    server = start_server({"wide": '{"p": "abcdefghijkl", "w": {"k1": "x"}}'}, engine=served_engine(max_batch=4))
    schema = {"type": "object", "required": ["p", "w"], "properties": {
        "p": {"type": "string", "minLength": 12, "maxLength": 12}, "w": _wide(500)}}
    body = {"model": "m", "max_tokens": 80, "messages": [{"role": "user", "content": "FORCE:wide"}]}
    chat = {**body, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json=chat)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and "could no longer be enforced" in error["message"], error
    assert error["type"] == "invalid_request_error"
    streamed = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={**chat, "stream": True}).text
    assert '"type": "invalid_request_error"' in streamed.replace('":"', '": "') and streamed.rstrip().endswith("[DONE]")
    messages = {**body, "stream": True, "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    streamed = httpx.post(server.url + "/v1/messages", timeout=60, json=messages).text
    assert "event: error" in streamed and "invalid_request_error" in streamed, streamed[-400:]
    assert "'output_config.format': the answer's format could no longer be enforced" in streamed
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_forced_call_to_a_deferred_tool_is_held_to_its_schema(server):
    # Tool search: a tool marked defer_loading is not listed up front; forcing a call to it
    # lists it, and the call is held to its schema (it came back as text, its arguments free).
    import httpx

    weather = {"name": "get_weather", "defer_loading": True, "input_schema": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"],
        "additionalProperties": False}}
    other = {"name": "other", "input_schema": {"type": "object", "properties": {}}}
    r = httpx.post(server.url + "/v1/messages", timeout=120, json={
        "model": "m", "max_tokens": 400, "messages": [{"role": "user", "content": "weather?"}],
        "tools": [weather, other], "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert r.status_code == 200, r.text
    calls = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert [c["name"] for c in calls] == ["get_weather"], r.text
    assert set(calls[0]["input"]) == {"city"} and len(calls[0]["input"]["city"]) <= 4


def _ref_chain(hops: int) -> dict:
    """A flat chain of `hops` $refs (3000 of them overflowed llguidance's compile stack)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(hops - 1)}
    defs[f"d{hops - 1}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


@pytest.mark.slow
def test_a_schema_past_the_bounds_is_a_400_and_harms_no_other_request(server, oai):
    import httpx

    chat = dict(model="m", max_tokens=48, temperature=0, messages=[{"role": "user", "content": "Go on."}])
    alone = oai.chat.completions.create(**chat).choices[0].message.content
    streamed = []
    worker = threading.Thread(target=lambda: streamed.extend(
        c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **chat) if c.choices))
    worker.start()
    deep, fmt = _ref_chain(3000), {"type": "json_schema"}
    user = [{"role": "user", "content": "x"}]
    for path, body, field in [
        ("/v1/chat/completions", {"messages": user, "response_format": {
            **fmt, "json_schema": {"name": "d", "schema": deep}}}, "response_format"),
        ("/v1/responses", {"input": "x", "text": {"format": {**fmt, "name": "d", "schema": deep}}}, "text.format"),
        ("/v1/messages", {"messages": user, "output_config": {"format": {**fmt, "schema": deep}}},
         "output_config.format"),
    ]:
        r = httpx.post(server.url + path, timeout=60, json={"model": "m", "max_tokens": 4, **body})
        assert r.status_code == 400 and field in r.text and "nested 3001 levels" in r.text and "256" in r.text, r.text
    for schema, message in [(_ref_chain(200), None),  # within the bounds: held as any schema
                            ({"enum": list(range(20000))}, "20000 enum values (at most 10000)"),
                            ({"anyOf": [{"type": "null"}] * 10001}, "more than 10000 subschemas"),
                            ({"type": "string", "pattern": "x" * 5000}, "a pattern of 5000 characters"),
                            # compiles, then llguidance's lexer gives up at the string's first quote
                            ({"type": "string", "pattern": "^(x{1000}){1000}$"}, "too many expressions"),
                            ({"type": "object", "patternProperties": {"^(a{1000}){1000}$": {}}},
                             "too many expressions")]:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={**chat, "max_tokens": 4, "response_format": {
            **fmt, "json_schema": {"name": "s", "schema": schema}}})
        if message is None:
            assert r.status_code == 200, r.text
        else:
            assert r.status_code == 400 and message in r.json()["error"]["message"], (message, r.text)
            assert r.json()["error"]["param"] == "response_format", r.text
    worker.join(timeout=120)
    assert "".join(streamed) == alone
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_an_answer_the_grammar_stops_holding_fails_rather_than_going_on_free(fixture_model):
    # A grammar whose lexer gives up after its first token (the pattern llguidance compiles,
    # then cannot build; compile_schema refuses it up front, so it is built here directly).
    import llguidance

    from mlxmtp.server.grammar_mask import GrammarError

    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    serve_tokenizer(tok, 320)
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "pattern": "^(x{1000}){1000}$"})
    proc = grammar_processor(grammar, 0)
    quote = tok.encode('"', add_special_tokens=False)
    first = proc(mx.array([], dtype=mx.int32), mx.zeros((1, 320)))
    assert mx.isinf(first).sum().item() == 319  # only the quote opens the string
    with pytest.raises(GrammarError, match="too many expressions"):
        proc(mx.array(quote), mx.zeros((1, 320)))


def _reasoning_first(tok, text):
    """request_hook: the output starts with `text` (the model's reasoning), then is free."""
    ids = tok.encode(text, add_special_tokens=False)

    def hook(req, body):
        def proc(ctx, logits, n=len(req.prompt)):
            i = int(ctx.shape[0]) - n
            if i >= len(ids):
                return logits
            return mx.where(mx.arange(logits.shape[-1]) == ids[i], 0.0, -1e9).astype(logits.dtype)[None]

        req.params.logits_processors.insert(0, proc)

    return hook


def test_reasoning_stays_free_and_the_answer_after_it_is_held(start_server, tmp_path):
    # A template that opens <think> in the prompt (Qwen3.5/3.6): the reasoning is the
    # model's own, the schema holds from </think> on.
    from mlx_lm.tokenizer_utils import load as load_tok

    from mlxmtp.testing.fixtures import CHAT_TEMPLATE, write_tokenizer

    tok = load_tok(write_tokenizer(tmp_path))
    off = "{%- if enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}"
    tok._tokenizer.chat_template = CHAT_TEMPLATE.replace(off, off + "\n    {%- else %}\n        {{- '<think>\\n' }}")
    srv = start_server(hook=_reasoning_first(tok, "I will answer in JSON.\n</think>\n\n"), tok=tok)
    import openai

    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = oai.chat.completions.create(model="m", max_tokens=600, temperature=0, messages=[
        {"role": "user", "content": "Describe it."}],
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}})
    m = r.choices[0].message
    assert m.reasoning_content == "I will answer in JSON." and valid(json.loads(m.content)), m
