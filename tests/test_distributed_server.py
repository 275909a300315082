"""`mlxmtp serve` on 2 ranks (rank 0 serves HTTP) against the same server in one process:
a subset of the server tests, answer for answer; then the faults: a rank killed or
stopped mid-request fails the request with an error and rank 0 exits non-zero within
the timeout; ranks with different model folders refuse to start."""

import json
import os
import shutil
import signal
import subprocess
import time

import anthropic
import httpx
import openai
import pytest
from dist_helpers import BIN, free_port, start_ranks
from server_helpers import ServerThread, served_engine, streams_solo_and_together

from mlxmtp.server.app import create_app
from mlxmtp.server.config import ServerConfig
from mlxmtp.testing.fixtures import write_hf_checkpoint

pytestmark = pytest.mark.slow
MODEL = "fixture"


class Ranks:
    """Two `mlxmtp serve` processes, one per rank; rank 0 listens on `url`."""

    def __init__(self, tmp_path, model_dirs, *extra):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [[str(BIN / "mlxmtp"), "serve", "--model", str(d), "--port", str(self.port), *extra] for d in model_dirs]
        self.procs = start_ranks(tmp_path, args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_up(self, timeout=240):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise AssertionError(f"a rank exited while starting:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError("the server did not come up")

    def wait_exit(self, rank, timeout):
        return self.procs[rank].wait(timeout=timeout)

    def output(self, rank=None):
        outs = []
        for p in self.procs if rank is None else [self.procs[rank]]:
            if p.poll() is None:
                p.kill()
            outs.append(p.communicate()[0] or "")
        return "\n".join(outs)

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            try:
                p.communicate(timeout=10)
            except ValueError:  # output() read it already
                pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("dist_server") / "model", "qwen3_5")


@pytest.fixture(scope="module")
def two_ranks(model_dir, tmp_path_factory):
    # A pinned depth: a seeded request then draws the same numbers in both servers (the
    # adaptive depth follows timings, and each depth consumes randomness its own way).
    ranks = Ranks(tmp_path_factory.mktemp("hosts"), [model_dir, model_dir], "--dist-timeout", "60", "--num-draft", "2")
    try:
        yield ranks.wait_up()
    finally:
        ranks.kill()


@pytest.fixture(scope="module")
def one_process(model_dir):
    from mlxmtp.models.generation_config import recommended_sampling
    from mlxmtp.models.load import load

    model, tok = load(str(model_dir))
    # As `mlxmtp serve` makes it: requests without sampling fields get the model's own.
    defaults = recommended_sampling(model.model_dir)
    app = create_app(model, tok, ServerConfig(model_id=MODEL, sampling_defaults=defaults), served_engine(num_draft=2))
    with ServerThread(app) as srv:
        yield srv


def _clients(url):
    return (openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120),
            anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120))


def _chat(oai, text, **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 0)
    return oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], **kw)


def _answers(url):
    """What each checked request returns (ids and timestamps left out)."""
    oai, ant = _clients(url)
    out = {"chat": _chat(oai, "Hello there").choices[0].message.content,
           "chat_stream": "".join(c.choices[0].delta.content or "" for c in _chat(oai, "Hello there", stream=True)
                                  if c.choices),
           "completion": oai.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=12,
                                                temperature=0).choices[0].text,
           "seeded": [_chat(oai, "Pick", temperature=0.8, seed=7).choices[0].message.content for _ in range(2)],
           "stop": _chat(oai, "Hello there", stop=["e"]).choices[0].finish_reason,
           # Held to a schema: every rank runs the grammar (its processor travels as a recipe).
           "json": _chat(oai, "Describe", max_tokens=300, response_format={"type": "json_schema", "json_schema": {
               "name": "t", "schema": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
                                       "required": ["n"], "additionalProperties": False}}}).choices[0].message.content}
    lp = _chat(oai, "Hi", logprobs=True, top_logprobs=2, max_tokens=4).choices[0].logprobs.content
    out["logprobs"] = [(t.token, [x.token for x in t.top_logprobs]) for t in lp]
    msg = ant.messages.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0},
                              messages=[{"role": "user", "content": "Hello there"}])
    out["anthropic"] = [b.text for b in msg.content if b.type == "text"]
    thought = ant.messages.create(model=MODEL, max_tokens=24, extra_body={"temperature": 0},
                                  messages=[{"role": "user", "content": "Think"}],
                                  thinking={"type": "enabled", "budget_tokens": 4})
    out["thinking_budget"] = [b.type for b in thought.content]
    return out


def test_two_rank_server_answers_as_one_process(two_ranks, one_process):
    got = _answers(two_ranks.url)
    assert got == _answers(one_process.url)
    assert got["seeded"][0] == got["seeded"][1]  # every rank drew the same numbers
    assert 0 <= json.loads(got["json"])["n"] <= 9
    health = httpx.get(two_ranks.url + "/health").json()
    assert health["status"] == "ok" and health["mtp_active"]


def test_two_rank_server_concurrent_streams_equal_solo(two_ranks):
    prompts = [f"Request number {i}: " + "word " * i for i in range(6)]
    solo, together = streams_solo_and_together(two_ranks.url, MODEL, prompts, 20)
    assert together == solo


def test_two_rank_server_bad_input_and_disconnect(two_ranks):
    r = httpx.post(two_ranks.url + "/v1/chat/completions", json={"model": MODEL, "messages": "nope"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 100000, "stream": True}
    with httpx.stream("POST", two_ranks.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i > 5:
                break  # the client goes away; the cancellation reaches every rank
    deadline = time.time() + 30
    while time.time() < deadline and httpx.get(two_ranks.url + "/health").json()["active"]:
        time.sleep(0.2)
    assert httpx.get(two_ranks.url + "/health").json()["active"] == 0
    oai, _ = _clients(two_ranks.url)
    assert _chat(oai, "still there?").choices[0].finish_reason in ("stop", "length")


def _cpu_seconds(pid: int) -> float:
    """CPU seconds process `pid` has used (user + system)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except FileNotFoundError:  # no /proc (macOS): ps's [[dd-]hh:]mm:ss
        out = subprocess.run(["ps", "-o", "time=", "-p", str(pid)], capture_output=True, text=True).stdout
        seconds = 0.0
        for part in out.strip().replace("-", ":").split(":"):
            seconds = seconds * 60 + float(part)
        return seconds


def test_an_idle_server_keeps_no_core_busy(two_ranks):
    """Rank 1 waits for rank 0's next message. Inside a collective, MLX's ring backend polls
    for it, which kept a core busy on rank 1 for as long as the server was idle (a second of
    CPU a second); it now waits for the data outside (distributed/links.py) and still answers."""
    oai, _ = _clients(two_ranks.url)
    _chat(oai, "Hello there")
    time.sleep(1.0)
    rank_1 = two_ranks.procs[1].pid
    before, started = _cpu_seconds(rank_1), time.monotonic()
    time.sleep(4.0)
    used = (_cpu_seconds(rank_1) - before) / (time.monotonic() - started)
    assert used < 0.25, f"rank 1 used {used:.2f} s of CPU a second while idle"
    assert _chat(oai, "Hello there").choices[0].finish_reason in ("stop", "length")


def test_sigterm_stops_both_ranks_cleanly(two_ranks):
    two_ranks.procs[0].send_signal(signal.SIGTERM)
    assert two_ranks.wait_exit(0, 60) == 0
    assert two_ranks.wait_exit(1, 60) == 0  # rank 0 told it the run is over


# ------------------------------------------------------------------ faults
def _stream_until_failure(url, on_started):
    """Open a long stream, call on_started() after a few events -> (the last data lines, seconds
    from on_started to the end of the stream)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 100000, "stream": True}
    lines, t0 = [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            lines.append(line)
            if t0 is None and len(lines) > 8:
                on_started()
                t0 = time.time()
    return [x for x in lines if x.startswith("data:")][-2:], time.time() - t0


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_lost_rank_fails_the_request_and_rank_0_exits(model_dir, tmp_path, fault):
    timeout = 6
    ranks = Ranks(tmp_path, [model_dir, model_dir], "--dist-timeout", str(timeout)).wait_up()
    try:
        sig = signal.SIGKILL if fault == "killed" else signal.SIGSTOP
        tail, seconds = _stream_until_failure(ranks.url, lambda: ranks.procs[1].send_signal(sig))
        error = json.loads(tail[0][len("data:"):])["error"]
        assert "distributed engine failed" in error["message"] and tail[1] == "data: [DONE]"
        assert seconds < timeout + 10
        assert ranks.wait_exit(0, timeout + 10) != 0
    finally:
        ranks.kill()


def test_ranks_with_different_folders_refuse_to_start(model_dir, tmp_path):
    other = shutil.copytree(model_dir, tmp_path / "other")
    cfg = json.loads((other / "config.json").read_text())
    cfg["text_config"]["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(cfg))
    ranks = Ranks(tmp_path, [model_dir, other])
    try:
        codes = [ranks.wait_exit(r, 120) for r in (0, 1)]
        out = ranks.output()
        assert all(c != 0 for c in codes), out
        assert "rank(s) [1] have a different model folder than rank 0" in out
    finally:
        ranks.kill()
