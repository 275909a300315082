"""Bad input, as an attacker or a careless client sends it, against a real server.

Every case gets a 4xx in its API's own error shape naming the field, /health still
answers, and a normal request still gives the same output as before it; poison sent
while streams run leaves those streams' output equal to their solo runs.
"""

import json
import threading

import httpx
import pytest

MODEL = "fixture"
CONTEXT = 256
NAN, INF = float("nan"), float("inf")
USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}]
LONG = "x " * (CONTEXT + 50)


def chat(**kw):
    return ("/v1/chat/completions", dict({"model": MODEL, "messages": USER, "max_tokens": 4}, **kw))


def completion(**kw):
    return ("/v1/completions", dict({"model": MODEL, "prompt": "hi", "max_tokens": 4}, **kw))


def message(**kw):
    return ("/v1/messages", dict({"model": MODEL, "messages": USER, "max_tokens": 4}, **kw))


def count(**kw):
    return ("/v1/messages/count_tokens", dict({"model": MODEL, "messages": USER}, **kw))


def without(case, key):
    path, body = case
    return path, {k: v for k, v in body.items() if k != key}


V = 320  # the fixture's vocabulary
# (endpoint and body, status, what the error message must name)
CASES = [
    (chat(logit_bias={"100000000": 5}), 400, "logit_bias"),
    (chat(logit_bias={"999999": 5}), 400, "logit_bias"),
    (chat(logit_bias={str(V): 5}), 400, "logit_bias"),
    (chat(logit_bias={"-1": 100}), 400, "logit_bias"),
    (chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    (chat(logit_bias={"5": "x"}), 400, "logit_bias.5"),
    (chat(logit_bias={"5": 101}), 400, "logit_bias.5"),
    (chat(logit_bias={"5": NAN}), 400, "logit_bias.5"),
    (chat(logit_bias=[1, 2]), 400, "logit_bias"),
    (chat(seed=-1), 400, "seed"),
    (chat(seed=2**64), 400, "seed"),
    (chat(seed=1.5), 400, "seed"),
    (chat(seed="1"), 400, "seed"),
    (chat(temperature=NAN), 400, "temperature"),
    (chat(temperature=INF), 400, "temperature"),
    (chat(temperature=-INF), 400, "temperature"),
    (chat(temperature=1e9), 400, "temperature"),
    (chat(temperature=2.5), 400, "temperature"),
    (chat(temperature=-0.1), 400, "temperature"),
    (chat(top_p=0), 400, "top_p"),
    (chat(top_p=1.01), 400, "top_p"),
    (chat(top_p=NAN), 400, "top_p"),
    (chat(top_k=-2), 400, "top_k"),
    (chat(top_k=V), 400, "top_k"),
    (chat(min_p=1.5), 400, "min_p"),
    (chat(min_p=-0.1), 400, "min_p"),
    (chat(repetition_penalty=NAN), 400, "repetition_penalty"),
    (chat(repetition_penalty=0), 400, "repetition_penalty"),
    (chat(repetition_penalty=-1), 400, "repetition_penalty"),
    (chat(presence_penalty=NAN), 400, "presence_penalty"),
    (chat(presence_penalty=3), 400, "presence_penalty"),
    (chat(frequency_penalty=-2.5), 400, "frequency_penalty"),
    (chat(num_draft=5), 400, "num_draft"),
    (chat(num_draft=16), 400, "num_draft"),
    (chat(num_draft=-1), 400, "num_draft"),
    (chat(num_draft="2"), 400, "num_draft"),
    (chat(max_tokens=0), 400, "max_tokens"),
    (chat(max_tokens=-1), 400, "max_tokens"),
    (chat(max_tokens=1.5), 400, "max_tokens"),
    (chat(max_tokens=True), 400, "max_tokens"),
    (chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    (chat(n=2), 400, "n=1"),
    (chat(n=0), 400, "'n'"),
    (chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    (chat(top_logprobs=5), 400, "top_logprobs"),
    (chat(logprobs="yes"), 400, "logprobs"),
    (chat(tool_choice="required"), 400, "tool_choice"),
    (chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}}), 400, "tool_choice"),
    (chat(tools=TOOLS, tool_choice="sometimes"), 400, "tool_choice"),
    (chat(tools=TOOLS, tool_choice={"type": "function"}), 400, "tool_choice"),
    (chat(messages=[{"role": "user", "content": "bad \ud800 text"}]), 400, "messages[0].content"),
    (chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]), 400, "messages[0]"),
    (chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0]"),
    (chat(messages=None), 400, "messages"),
    (chat(messages=[]), 400, "messages"),
    (chat(messages="hi"), 400, "messages"),
    (chat(messages=[5]), 400, "messages[0]"),
    (chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0]"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "messages[0]"),
    (chat(messages=[{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]), 400, "messages[0]"),
    (chat(tools=[{"type": "function"}]), 400, "tools[0]"),
    (chat(tools="x"), 400, "tools"),
    (chat(stop=5), 400, "stop"),
    (chat(stop=[1]), 400, "stop"),
    (chat(stream="yes"), 400, "stream"),
    (chat(stream_options={"include_usage": "y"}), 400, "stream_options.include_usage"),
    (chat(chat_template_kwargs={"enable_thinking": "y"}), 400, "enable_thinking"),
    (chat(chat_template_kwargs={"chat_template": "{{ 'x' }}"}), 400, "chat_template_kwargs.chat_template"),
    (chat(chat_template_kwargs={"add_generation_prompt": False}), 400, "chat_template_kwargs.add_generation_prompt"),
    (chat(chat_template_kwargs={"namespace": None}), 400, "chat_template_kwargs.namespace"),  # named messages before
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]), 400,
     "tools[0].function.parameters"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"properties": "x"}}}]), 400,
     "tools[0].function.parameters.properties"),
    (without(chat(), "model"), 400, "model"),
    (chat(model=5), 400, "model"),
    (chat(model="nope"), 404, "nope"),
    (chat(messages=[{"role": "user", "content": LONG}]), 400, "maximum context length"),
    (("/v1/chat/completions", b"[1, 2]"), 400, "JSON object"),
    (("/v1/chat/completions", b"{not json"), 400, "JSON"),
    (("/v1/chat/completions", b""), 400, "JSON"),
    (("/v1/chat/completions", b"[" * 100000 + b"]" * 100000), 400, "JSON"),
    (("/v1/chat/completions", b'{"model": "fixture", "messages": [{"role": "user", "content": "' + b"x" * (2**20 + 10)
      + b'"}]}'), 413, "MiB"),
    (completion(best_of=2), 400, "best_of"),
    (completion(suffix="\n    return x"), 400, "suffix"),
    (completion(prompt=[-1, 5]), 400, "prompt[0]"),
    (completion(prompt=[5, V]), 400, "prompt[1]"),
    (completion(prompt=[2**70]), 400, "prompt[0]"),
    (completion(prompt=[]), 400, "prompt"),
    (completion(prompt=""), 400, "prompt"),
    (completion(prompt=5), 400, "prompt"),
    (completion(prompt=[[1, 2], [3]]), 400, "prompt"),
    (completion(prompt="\ud800"), 400, "prompt"),
    (completion(prompt=LONG), 400, "maximum context length"),
    (completion(logprobs=6), 400, "logprobs"),
    (completion(logprobs=-1), 400, "logprobs"),
    (completion(echo=True), 400, "echo"),
    (completion(seed=-1), 400, "seed"),
    (completion(temperature=NAN), 400, "temperature"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "number", "maximum": INF}}}}}]), 400,
     "tools[0].function.parameters.properties.x.maximum"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": json.loads(
        '{"type": "object", "properties": {"x": ' + '{"items": ' * 300 + "{}" + "}" * 300 + "}}")}}]), 400,
     "'tools' is nested deeper than 128"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"minimum": NAN}}}), 400,
     "response_format.json_schema.schema.minimum"),
    (completion(logit_bias={"999999": 5}), 400, "logit_bias"),
    (chat(logit_bias={"5": None}), 400, "logit_bias.5"),
    (chat(reasoning_effort="maximal"), 400, "reasoning_effort"),
    (completion(max_tokens=0), 400, "max_tokens"),
    (message(temperature=5), 400, "temperature"),
    (message(temperature=1.5), 400, "temperature"),
    (message(temperature=NAN), 400, "temperature"),
    (message(top_p=0), 400, "top_p"),
    (message(metadata={"user_id": -INF}), 400, "metadata.user_id"),
    (message(metadata={"k": json.loads("[" * 200 + "]" * 200)}), 400, "'metadata' is nested deeper than 128"),
    (message(top_k=-1), 400, "top_k"),
    (message(tools=[{"name": "f", "input_schema": {"type": "object", "properties": "bad"}}]), 400,
     "tools.0.input_schema.properties"),
    (message(tools=[{"name": "f", "input_schema": [1]}]), 400, "tools.0.input_schema"),
    (without(message(), "max_tokens"), 400, "max_tokens"),
    (message(max_tokens=0), 400, "max_tokens"),
    (message(seed=-1), 400, "seed"),
    (message(num_draft=9), 400, "num_draft"),
    (message(messages=[]), 400, "messages"),
    (message(messages=[{"role": "robot", "content": "x"}]), 400, "messages.0.role"),
    (message(messages=[{"role": "user", "content": [{"type": "image"}]}]), 400, "messages.0"),
    (message(messages=[{"role": "user", "content": "\ud800"}]), 400, "messages[0].content"),
    (message(tool_choice={"type": "any"}), 400, "tool_choice"),
    (message(tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "missing"}), 400, "tool_choice.name"),
    (message(tools=ANTHROPIC_TOOLS, tool_choice={"type": "sometimes"}), 400, "tool_choice.type"),
    (message(thinking={"type": "maybe"}), 400, "thinking.type"),
    (message(system=5), 400, "system"),
    (message(stop_sequences=5), 400, "stop_sequences"),
    (message(messages=[{"role": "user", "content": LONG}]), 400, "prompt is too long"),
    (message(model="nope"), 404, "nope"),
    (without(count(), "messages"), 400, "messages"),
    (without(count(), "model"), 400, "model"),
    (count(messages="x"), 400, "messages"),
    (count(messages=[{"role": "user", "content": "\ud800"}]), 400, "messages[0].content"),
    (count(messages=[{"role": "robot", "content": "x"}]), 400, "messages.0.role"),
]


def encode(body) -> bytes:
    # NaN and Infinity as JavaScript writes them: Python's json reads them, clients send them.
    return body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()


@pytest.fixture(scope="module")
def server(start_server):
    # Strict model names: an unknown name is one of the rejections catalogued here.
    return start_server(model_id=MODEL, context_length=CONTEXT, max_body_mb=1, strict_model_name=True)


@pytest.fixture(scope="module")
def normal(server):
    """A normal request and its output before any bad input."""
    path, body = chat(messages=[{"role": "user", "content": "a normal request"}], max_tokens=6, temperature=0)
    text = httpx.post(server.url + path, json=body, timeout=60).json()["choices"][0]["message"]["content"]
    return path, body, text


def assert_error_shape(path: str, r: httpx.Response, names: str):
    j = r.json()
    if path.startswith("/v1/messages"):
        assert j["type"] == "error" and set(j["error"]) == {"type", "message"}, j
        assert j["error"]["type"] == ("not_found_error" if r.status_code == 404 else
                                      "request_too_large" if r.status_code == 413 else "invalid_request_error")
        message = j["error"]["message"]
    else:
        assert set(j["error"]) == {"message", "type", "param", "code"}, j
        assert j["error"]["type"] == "invalid_request_error"
        message = j["error"]["message"]
    assert names in message, message


def test_the_catalogue_is_large():
    assert len(CASES) >= 80


@pytest.mark.parametrize("case,status,names", CASES, ids=[f"{c[0][0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_gets_a_4xx_naming_the_field(server, normal, case, status, names):
    path, body = case
    r = httpx.post(server.url + path, content=encode(body), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    assert_error_shape(path, r, names)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    npath, nbody, ntext = normal
    again = httpx.post(server.url + npath, json=nbody, timeout=60).json()
    assert again["choices"][0]["message"]["content"] == ntext


def test_context_length_exceeded_is_typed_for_openai_clients(server):
    path, body = chat(messages=[{"role": "user", "content": LONG}])
    err = httpx.post(server.url + path, json=body, timeout=30).json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert f"maximum context length is {CONTEXT} tokens" in err["message"]


def test_max_tokens_defaults_to_and_is_capped_at_the_room_left(server):
    for extra in ({}, {"max_tokens": 10**9}):
        path, body = chat(**extra)
        body.pop("max_tokens", None) if not extra else None
        r = httpx.post(server.url + path, json=body, timeout=120).json()
        u = r["usage"]
        assert r["choices"][0]["finish_reason"] == "length"
        assert u["prompt_tokens"] + u["completion_tokens"] == CONTEXT


def test_wrong_method_on_messages_is_typed_invalid_request(server):
    r = httpx.get(server.url + "/v1/messages", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_chunked_body_over_the_limit_gets_413(server):
    def chunks():
        for _ in range(20):
            yield b"x" * 2**17

    r = httpx.post(server.url + "/v1/chat/completions", content=chunks(), timeout=30)
    assert r.status_code == 413 and "MiB" in r.json()["error"]["message"]


def stream_text(url: str, body: dict) -> str:
    out = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=dict(body, stream=True), timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    out.append(c["delta"].get("content") or "")
    return "".join(out)


def test_poison_sent_while_streams_run_leaves_them_equal_to_solo(server):
    bodies = [chat(messages=[{"role": "user", "content": f"stream {i}"}], max_tokens=40, temperature=0)[1]
              for i in range(3)]
    solo = [stream_text(server.url, b) for b in bodies]
    poison = [c for c in CASES if c[1] == 400][:40]
    results = [None] * 3

    def run(i):
        results[i] = stream_text(server.url, bodies[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for (path, body), status, _ in poison:
        r = httpx.post(server.url + path, content=encode(body), headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == status
    for t in threads:
        t.join(120)
    assert results == solo
    assert server.state.bridge.restarts == 0


@pytest.mark.parametrize("extra", [{"temperature": 1e-40}, {"temperature": 5e-324, "logprobs": True},
                                   {"temperature": 0.7, "top_p": 5e-324}, {"temperature": 1e-300, "top_p": 1e-9}])
def test_a_temperature_or_top_p_too_small_for_float32_decodes_greedily(server, normal, extra):
    # 1 / 1e-40 overflows float32 and 1 - 5e-324 rounds to 1: the sampler saw inf / NaN
    # logits, or every token masked, and wrote garbage (with logprobs -inf: a 500).
    path, body, text = normal
    r = httpx.post(server.url + path, json={**body, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == text


def test_tiny_temperatures_are_greedy_and_small_ones_are_not():
    from mlxmtp.engine.sampling.params import SamplingParams

    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=0.7, top_p=1e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy and not SamplingParams(temperature=0.7, top_p=1e-5).greedy


@pytest.mark.slow
def test_a_huge_body_being_prepared_holds_up_no_other_request(start_server, monkeypatch):
    # A multi-MiB prompt takes seconds to parse and tokenize (and is then refused as too
    # long); requests behind it are prepared in the other lane meanwhile. Its preparation is
    # held here until the small request has its answer: in one shared lane that would wait.
    from mlxmtp.server import openai_api
    from mlxmtp.server.server_state import LARGE_BODY

    srv = start_server(model_id=MODEL, context_length=CONTEXT, max_body_mb=4)
    entered, release = threading.Event(), threading.Event()
    real = openai_api.parse_json_body

    def held_when_large(raw):
        if len(raw) > LARGE_BODY:
            entered.set()
            release.wait(60)
        return real(raw)

    monkeypatch.setattr(openai_api, "parse_json_body", held_when_large)
    path, big = chat(messages=[{"role": "user", "content": "x " * LARGE_BODY}])
    answers = {}
    waiter = threading.Thread(target=lambda: answers.update(big=httpx.post(srv.url + path, json=big, timeout=90)))
    waiter.start()
    try:
        assert entered.wait(30)
        path, small = chat(messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert httpx.post(srv.url + path, json=small, timeout=20).status_code == 200
        assert "big" not in answers
    finally:
        release.set()
        waiter.join()
    assert answers["big"].status_code == 400 and "maximum context length" in answers["big"].text
    # Either lane's tokenizer gives the same prompts: Anthropic's count_tokens of n repeats,
    # n = 1000 and 2000 (the usual lane) and LARGE_BODY / 2 (the large one), is linear in n.
    tokens = {n: httpx.post(srv.url + "/v1/messages/count_tokens", timeout=60, json=count(
        messages=[{"role": "user", "content": "y " * n}])[1]).json()["input_tokens"]
        for n in (1000, 2000, LARGE_BODY // 2)}
    per_repeat = (tokens[2000] - tokens[1000]) / 1000
    assert tokens[LARGE_BODY // 2] - tokens[1000] == per_repeat * (LARGE_BODY // 2 - 1000)
