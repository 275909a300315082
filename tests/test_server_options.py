"""`serve --max-tokens`, `--prefill-step-size` and `--allowed-origins`, from the command
line to what a client sees."""

from unittest import mock

import httpx
import pytest
from click.testing import CliRunner
from server_helpers import served_engine

from mlxmtp.commands.main import main
from mlxmtp.testing.fixtures import write_hf_checkpoint

RUN = "mlxmtp.server.shutdown.run_server"  # serving itself; mocked so nothing blocks
WORDS = "one two three four five six seven eight nine ten " * 3


def _post(srv, path, body, **kw):
    return httpx.post(srv.url + path, json={"model": "m", **body}, timeout=60, **kw)


def test_the_options_reach_the_app_and_its_engine(tmp_path):
    path = write_hf_checkpoint(tmp_path / "m", "qwen3_5")
    with mock.patch(RUN) as run:
        res = CliRunner().invoke(main, ["serve", "--model", str(path), "--max-tokens", "7", "--prefill-step-size",
                                        "32", "--allowed-origins", "http://localhost:3000, https://a.example"])
    assert res.exit_code == 0, res.output
    app = run.call_args.args[0]
    assert app.state.server.default_max_tokens == 7
    assert app.entry.allow_origins == ["http://localhost:3000", "https://a.example"]
    engine = app.state.server.bridge._make_engine()
    assert engine.prefiller.step == 32
    with mock.patch(RUN) as run:
        res = CliRunner().invoke(main, ["serve", "--model", str(path)])
    app = run.call_args.args[0]
    assert app.state.server.default_max_tokens is None and app.entry == app._guarded
    assert app.state.server.bridge._make_engine().prefiller.step == 512


@pytest.mark.slow
def test_max_tokens_limits_only_the_requests_that_set_none(start_server):
    srv = start_server({"long": WORDS}, default_max_tokens=5)
    chat = {"messages": [{"role": "user", "content": "FORCE:long"}]}
    out = _post(srv, "/v1/chat/completions", chat).json()
    assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length"
    out = _post(srv, "/v1/chat/completions", {**chat, "max_tokens": 9}).json()
    assert out["usage"]["completion_tokens"] == 9
    out = _post(srv, "/v1/responses", {"input": "FORCE:long"}).json()
    assert out["usage"]["output_tokens"] == 5 and out["status"] == "incomplete"
    out = _post(srv, "/v1/completions", {"prompt": "FORCE:long"}).json()
    assert out["usage"]["completion_tokens"] == 5  # the server's default replaces OpenAI's 16
    default = start_server({"long": WORDS})
    assert _post(default, "/v1/completions", {"prompt": "FORCE:long"}).json()["usage"]["completion_tokens"] == 16
    out = _post(default, "/v1/chat/completions", chat).json()
    assert out["usage"]["completion_tokens"] > 16 and out["choices"][0]["finish_reason"] == "stop"


def test_a_small_prefill_step_gives_the_same_output(start_server):
    prompt = {"messages": [{"role": "user", "content": WORDS * 2}], "max_tokens": 12, "temperature": 0}
    chunked = start_server(engine=served_engine(prefill_step=16))
    whole = start_server()
    a = _post(chunked, "/v1/chat/completions", prompt).json()
    b = _post(whole, "/v1/chat/completions", prompt).json()
    assert a["usage"]["prompt_tokens"] > 4 * 16  # read in several chunks
    assert chunked.state.bridge.engine.prefiller.step == 16
    assert a["choices"][0]["message"] == b["choices"][0]["message"]


def test_browsers_may_call_from_the_allowed_origins_only(start_server):
    srv = start_server(allowed_origins=("http://localhost:3000",), api_key="k")
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    res = httpx.options(srv.url + "/v1/chat/completions", headers=preflight)
    assert res.status_code == 200  # no API key on a preflight: browsers send none
    assert res.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "authorization" in res.headers["access-control-allow-headers"].lower()
    res = httpx.options(srv.url + "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert res.status_code == 400 and "access-control-allow-origin" not in res.headers
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    res = _post(srv, "/v1/chat/completions", body, headers={"Origin": "http://localhost:3000",
                                                            "Authorization": "Bearer k"})
    assert res.status_code == 200 and res.headers["access-control-allow-origin"] == "http://localhost:3000"
    res = _post(srv, "/v1/chat/completions", body, headers={"Origin": "http://localhost:3000"})
    assert res.status_code == 401 and res.headers["access-control-allow-origin"] == "http://localhost:3000"
    plain = start_server()
    res = _post(plain, "/v1/chat/completions", body, headers={"Origin": "http://localhost:3000"})
    assert res.status_code == 200 and "access-control-allow-origin" not in res.headers
    assert httpx.options(plain.url + "/v1/chat/completions", headers=preflight).status_code == 405
