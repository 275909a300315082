"""Bounded shutdown of a real `mlxmtp serve` subprocess (mlxmtp/server/shutdown.py).

SIGTERM: no new connections, open streams run for up to --shutdown-timeout seconds, then
each ends with its API's own final error event and the process exits 0. A second signal
exits at once. An empty API key is refused before anything loads.

The model is the float32 fixture (random weights): decoding greedily it never emits an end
token (sampled, it can), so a greedy stream with max_tokens 10**6 (capped by the server at the context room, ~4k tokens) is
still running when the grace period ends.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_helpers import load_bench_module

from mlxmtp.testing.fixtures import write_hf_checkpoint

GRACE = 2.0
bench = load_bench_module()
ServerProcess = bench.ServerProcess


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("shutdown") / "model", "qwen3_5")


@pytest.fixture()
def start(model_path):
    servers = []

    def go(*extra):
        srv = ServerProcess(str(model_path), extra=extra, log_level="info")
        servers.append(srv)
        return srv.start(timeout=90)  # a loaded 2-core machine may take a while to import and load

    yield go
    for srv in servers:
        srv.close()


class Stream(threading.Thread):
    """POST a streaming request and record (time, line) for every line received."""

    def __init__(self, url, path, body):
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.lines = []
        self.status = None
        self.error = None

    def run(self):
        try:
            with httpx.stream("POST", self.url + self.path, json=self.body,
                              timeout=httpx.Timeout(120, connect=30)) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    self.lines.append((time.monotonic(), line))
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def data_lines(self):
        return [(t, ln[len("data: "):]) for t, ln in self.lines if ln.startswith("data: ")]

    def wait_for_tokens(self, n=6, timeout=60):
        deadline = time.monotonic() + timeout
        while len(self.data_lines()) < n:
            assert self.is_alive() or len(self.data_lines()) >= n, (self.status, self.error, self.lines[-3:])
            assert time.monotonic() < deadline, f"no tokens within {timeout}s: {self.lines[-3:]}"
            time.sleep(0.05)


def _streams(url, model):
    msgs = [{"role": "user", "content": "Tell me a very long story."}]
    return {
        "chat": Stream(url, "/v1/chat/completions",
                       {"model": model, "messages": msgs, "max_tokens": 10**6, "temperature": 0, "stream": True}),
        "completions": Stream(url, "/v1/completions",
                              {"model": model, "prompt": "Once upon a time", "max_tokens": 10**6, "temperature": 0,
                               "stream": True}),
        "messages": Stream(url, "/v1/messages",
                           {"model": model, "messages": msgs, "max_tokens": 10**6, "temperature": 0, "stream": True}),
    }


def _wait_exit(srv, limit):
    t0 = time.monotonic()
    try:
        rc = srv.proc.wait(limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit within {limit}s:\n{srv.output()}")
    return rc, time.monotonic() - t0


def _check_openai_end(name, s, t_sig):
    data = s.data_lines()
    assert s.status == 200 and s.error is None, (name, s.status, s.error)
    assert data and data[-1][1] == "[DONE]", (name, data[-3:])
    t_err, last = data[-2]
    final = json.loads(last)  # well-formed JSON
    assert set(final) == {"error"} and final["error"]["message"], (name, final)
    assert "shutting down" in final["error"]["message"]
    # No normal ending before it: the stream was cut by the shutdown, not finished.
    assert not any('"finish_reason": "' in d or '"finish_reason":"' in d for _, d in data[:-2]), name
    return t_err


def _check_anthropic_end(s, t_sig):
    assert s.status == 200 and s.error is None, (s.status, s.error)
    lines = [(t, ln) for t, ln in s.lines if ln]
    assert lines[-2][1] == "event: error", lines[-4:]
    t_err, data = lines[-1]
    assert data.startswith("data: ")
    final = json.loads(data[len("data: "):])
    assert final["type"] == "error" and final["error"]["type"] and final["error"]["message"], final
    assert "shutting down" in final["error"]["message"]
    assert not any(ln == "event: message_stop" for _, ln in lines)
    return t_err


@pytest.mark.slow
def test_sigterm_ends_open_streams_with_their_error_event_and_exits_0(start):
    srv = start("--shutdown-timeout", str(GRACE), "--max-concurrent", "4")
    model = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    streams = _streams(srv.url, model)
    for s in streams.values():
        s.start()
    for s in streams.values():
        s.wait_for_tokens()
    t_sig = time.monotonic()
    srv.signal(signal.SIGTERM)

    # No new connections once shutdown has begun (the open streams keep going).
    refused = False
    while time.monotonic() < t_sig + GRACE - 0.3:
        try:
            httpx.get(srv.url + "/health", timeout=0.5)
        except httpx.ConnectError:
            refused = True
            break
        except (httpx.TimeoutException, httpx.ReadError, httpx.RemoteProtocolError):
            # A connection queued just as the listening socket closed is reset unanswered;
            # the next probe must then be refused.
            pass
        time.sleep(0.05)
    assert refused, "the server still accepted connections during the grace period"

    rc, took = _wait_exit(srv, GRACE + 2 + 1)
    assert rc == 0, srv.output()
    assert time.monotonic() - t_sig <= GRACE + 2, f"exit took {time.monotonic() - t_sig:.1f}s after SIGTERM"
    for s in streams.values():
        s.join(10)
    ends = {name: _check_openai_end(name, streams[name], t_sig) for name in ("chat", "completions")}
    ends["messages"] = _check_anthropic_end(streams["messages"], t_sig)
    for name, t_err in ends.items():
        # The grace period was honoured: tokens kept coming after the signal, and the
        # error event came only when it ran out.
        assert t_err >= t_sig + GRACE - 0.5, (name, t_err - t_sig)
        after = [t for t, _ in streams[name].lines if t_sig < t < t_err - 0.01]
        assert len(after) >= 2, (name, "no output during the grace period")


@pytest.mark.slow
@pytest.mark.parametrize("first,second", [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGTERM)],
                         ids=["TERM-TERM", "INT-TERM"])
def test_second_signal_exits_at_once(start, first, second):
    srv = start("--shutdown-timeout", "60")
    model = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    s = _streams(srv.url, model)["chat"]
    s.start()
    s.wait_for_tokens()
    srv.signal(first)
    time.sleep(0.5)
    assert srv.proc.poll() is None, "a first signal must not exit while a stream is open"
    srv.signal(second)
    rc, took = _wait_exit(srv, 5)
    assert took < 3, took
    assert rc == 128 + second, (rc, srv.output())  # mlxmtp/server/shutdown.py: os._exit(128 + signal)


@pytest.mark.slow
def test_idle_server_exits_0_on_sigterm(start):
    srv = start("--shutdown-timeout", "30")
    srv.signal(signal.SIGTERM)
    rc, took = _wait_exit(srv, 10)
    assert rc == 0 and took < 10, (rc, took, srv.output())


@pytest.mark.parametrize("args,env", [(["--api-key", ""], {}), (["--api-key", "  "], {}),
                                      ([], {"MLXMTP_API_KEY": ""}), ([], {"MLXMTP_API_KEY": " \t "})],
                         ids=["option-empty", "option-blank", "env-empty", "env-blank"])
def test_empty_api_key_is_refused_at_startup(args, env):
    # No --model: the refusal comes before any model is loaded, so this is quick.
    port = bench.free_port()
    full_env = {k: v for k, v in os.environ.items() if k != "MLXMTP_API_KEY"}
    full_env.update(env)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "mlxmtp.commands", "serve", "--port", str(port), *args],
                         capture_output=True, text=True, env=full_env, timeout=120)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "API key is empty" in res.stderr
    assert ("MLXMTP_API_KEY" if env else "--api-key") in res.stderr
    assert "serving on" not in res.stderr and "model:" not in res.stderr
    assert time.monotonic() - t0 < 60
