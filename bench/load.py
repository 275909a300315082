"""Load test of a real `mlxmtp serve` subprocess: one request never hurts another.

Sends N concurrent streaming requests (default 64) over both APIs (/v1/chat/completions,
/v1/completions, /v1/messages) with mixed prompt lengths, max_tokens 8..64, stop strings,
logprobs and pinned draft depths, all at temperature 0, plus ~10% poison requests that
the server must reject with a 400 in the API's own error shape. Then checks:

* every good stream is well formed and its text equals the same request run alone
  (sequentially, after the load): batching must not change a greedy output;
* every poison request got a 400 with the right error shape (and hurt no one else);
* no request was lost;
* the server's RSS after the load has grown by at most 10% over its level after a warm-up
  round of the same requests (the server runs with --prefix-cache-mb 0, so no cache holds
  memory); a smaller RSS is no leak (the allocator and MLX's buffer cache give memory back).

Outputs equal solo only when batched and solo forwards are bit-identical, so the default
model is a float32 fixture (random weights, written to a temporary folder).

    python bench/load.py [--model PATH] [--requests 64] [--port 0] [--max-concurrent 8]

Importable: `run(model_path, requests=...)` returns the report dict that `main` prints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union

import httpx

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hum about red apples "
         "green code and the river that runs past old stone bridges in winter").split()
RSS_TOLERANCE = 0.10


# ------------------------------------------------------------------ the server process
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m mlxmtp.commands serve ...` in a subprocess; its log goes to a temporary file
    (a pipe nobody reads would fill up and block the server)."""

    def __init__(self, model: Optional[str] = None, port: int = 0, extra: Sequence[str] = (),
                 log_level: str = "warning", env: Optional[dict] = None):
        self.port = port or free_port()
        self.cmd = [sys.executable, "-m", "mlxmtp.commands", "serve", "--port", str(self.port), "--log-level", log_level]
        if model:
            self.cmd += ["--model", str(model)]
        self.cmd += list(extra)
        self.env = env
        self.proc: Optional[subprocess.Popen] = None
        self.log = tempfile.NamedTemporaryFile(prefix="mlxmtp-serve-", suffix=".log", delete=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, timeout: float = 60.0) -> "ServerProcess":
        """Start and wait for /health (the model load can take a while on a busy machine)."""
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not answer /health within {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS in /proc/PID/status")

    def signal(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM, then SIGKILL if it does not go; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def close(self) -> None:
        self.stop()
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------ requests
@dataclass
class Spec:
    index: int
    path: str
    body: Union[dict, bytes]  # bytes: sent as is (JSON libraries refuse NaN)
    poison: str = ""  # what is wrong with it; "" for a good request

    @property
    def anthropic(self) -> bool:
        return self.path.startswith("/v1/messages")

    def payload(self) -> bytes:
        # ensure_ascii keeps a lone surrogate as the escape "\ud800" (valid JSON text)
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()


def poison_bodies(model: str) -> List[Tuple[str, str, Union[dict, bytes]]]:
    """(what is wrong, path, body): requests the server must answer with a 400."""
    msgs = [{"role": "user", "content": "hello there"}]

    def chat(**kw):
        return {"model": model, "messages": msgs, "max_tokens": 8, "temperature": 0, "stream": True, **kw}

    nan = json.dumps(chat(temperature=12345)).replace("12345", "NaN").encode()
    return [  # the first six are in every default run (~10% of 64); --poison 9 sends every kind
        ("logit_bias key outside the vocabulary", "/v1/chat/completions", chat(logit_bias={"100000000": 5})),
        ("seed -1", "/v1/chat/completions", chat(seed=-1)),
        ("temperature NaN", "/v1/chat/completions", nan),
        ("num_draft 9", "/v1/chat/completions", chat(num_draft=9)),
        ("lone surrogate in content", "/v1/chat/completions",
         chat(messages=[{"role": "user", "content": "abc \ud800 def"}])),
        ("negative token id in prompt", "/v1/completions",
         {"model": model, "prompt": [-1, 5], "max_tokens": 8, "temperature": 0, "stream": True}),
        ("top_k -5", "/v1/messages",
         {"model": model, "max_tokens": 8, "temperature": 0, "top_k": -5, "stream": True, "messages": msgs}),
        ("a schema of 3000 $ref hops (it once overflowed the grammar compiler's stack)", "/v1/chat/completions",
         chat(response_format={"type": "json_schema", "json_schema": {"name": "deep", "schema": _ref_chain(3000)}})),
        ("a pattern the grammar's lexer gives up on", "/v1/messages",
         {"model": model, "max_tokens": 8, "temperature": 0, "stream": True, "messages": msgs, "output_config": {
             "format": {"type": "json_schema", "schema": {"type": "string", "pattern": "^(x{1000}){1000}$"}}}}),
    ]


def _ref_chain(hops: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(hops - 1)}
    defs[f"d{hops - 1}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def build_specs(model: str, n: int, *, poison: Optional[int] = None, seed: int = 0) -> List[Spec]:
    """n requests, `poison` of them (default ~10%) poison; deterministic for a seed."""
    rng = random.Random(seed)
    bad = poison_bodies(model)
    n_poison = max(1, round(n * 0.1)) if poison is None else poison
    n_poison = min(n_poison, n)
    poison_at = set(rng.sample(range(n), n_poison))
    specs, k_bad, k_good = [], 0, 0
    for i in range(n):
        if i in poison_at:
            what, path, body = bad[k_bad % len(bad)]
            specs.append(Spec(i, path, body, poison=what))
            k_bad += 1
            continue
        kind = ("chat", "completions", "messages")[k_good % 3]
        k_good += 1
        n_words = rng.choice([1, 4, 12, 40, 120, 250])
        text = f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(n_words))
        max_tokens = rng.randint(8, 64)
        stop = rng.choice([None, None, ["e"], ["th", "\n\n"], "an"])
        depth = rng.choice([None, None, None, 0, 1, 3])
        extra = {} if depth is None else {"num_draft": depth}
        if rng.random() < 0.3:
            extra["top_p"] = 0.9  # no effect at temperature 0, but must be accepted
        if kind == "messages":
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "messages": [{"role": "user", "content": text}], **extra}
            if rng.random() < 0.3:
                body["system"] = "You are terse."
            if stop:
                body["stop_sequences"] = [stop] if isinstance(stop, str) else stop
            specs.append(Spec(i, "/v1/messages", body))
            continue
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **extra}
        if stop:
            body["stop"] = stop
        want_lp = rng.random() < 0.35
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": text}]
            if want_lp:
                body.update(logprobs=True, top_logprobs=2)
            specs.append(Spec(i, "/v1/chat/completions", body))
        else:
            body["prompt"] = [rng.randrange(3, 200) for _ in range(n_words)] if rng.random() < 0.25 else text
            if want_lp:
                body["logprobs"] = 2
            specs.append(Spec(i, "/v1/completions", body))
    return specs


# ------------------------------------------------------------------ one request
@dataclass
class Result:
    spec: Spec
    status: int = 0
    text: str = ""
    finish: Optional[str] = None
    tokens: int = 0
    problem: Optional[str] = None  # None: as the contract wants (a good stream, or a proper 400)
    raw: Any = field(default=None, repr=False)


async def sse_events(resp: httpx.Response) -> List[Tuple[Optional[str], str]]:
    """(event name or None, data) for each server-sent event."""
    events, name, data = [], None, []
    async for line in resp.aiter_lines():
        if not line:
            if data:
                events.append((name, "\n".join(data)))
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:][1:] if line[5:6] == " " else line[5:])
    if data:
        events.append((name, "\n".join(data)))
    return events


def error_shape_ok(anthropic: bool, j: Any) -> bool:
    """OpenAI: {"error": {message, type, param, code}}; Anthropic: {"type": "error", "error": {type, message}}."""
    if not isinstance(j, dict):
        return False
    if anthropic:
        err = j.get("error")
        return (j.get("type") == "error" and isinstance(err, dict) and isinstance(err.get("type"), str)
                and isinstance(err.get("message"), str) and bool(err["message"]))
    err = j.get("error")
    return (set(j) == {"error"} and isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and bool(err["message"]))


def _read_openai(res: Result, events) -> None:
    datas = [d for _, d in events]
    if not datas or datas[-1] != "[DONE]":
        res.problem = f"stream did not end with [DONE] (last: {datas[-1:]!r})"
        return
    chunks = [json.loads(d) for d in datas[:-1]]
    res.raw = chunks
    errors = [c["error"] for c in chunks if "error" in c]
    if errors:
        res.problem = f"error event: {errors[0]}"
        return
    chat = res.spec.path == "/v1/chat/completions"
    parts, finishes, n_lp = [], [], 0
    for c in chunks:
        if c.get("usage"):
            res.tokens = c["usage"].get("completion_tokens", 0)
        for ch in c.get("choices") or []:
            parts.append((ch.get("delta", {}).get("content") if chat else ch.get("text")) or "")
            if ch.get("finish_reason"):
                finishes.append(ch["finish_reason"])
            if ch.get("logprobs"):
                n_lp += 1
    res.text = "".join(parts)
    if len(finishes) != 1:
        res.problem = f"expected one finish_reason, got {finishes}"
        return
    res.finish = finishes[0]
    body = res.spec.body
    if (body.get("logprobs") or body.get("logprobs") == 0) and res.tokens and not n_lp:
        res.problem = "logprobs were asked for and none came"


def _read_anthropic(res: Result, events) -> None:
    names = [n for n, _ in events]
    res.raw = events
    if "error" in names:
        res.problem = f"error event: {dict(events)['error']}"
        return
    if not names or names[0] != "message_start" or names[-1] != "message_stop":
        res.problem = f"stream not message_start ... message_stop: {names[:1]} ... {names[-1:]}"
        return
    parts = []
    for name, data in events:
        p = json.loads(data)
        if name == "content_block_delta" and p["delta"].get("type") == "text_delta":
            parts.append(p["delta"]["text"])
        elif name == "message_delta":
            res.finish = p["delta"].get("stop_reason")
            res.tokens = p.get("usage", {}).get("output_tokens", 0)
    res.text = "".join(parts)
    if res.finish is None:
        res.problem = "no message_delta with a stop_reason"


async def run_one(client: httpx.AsyncClient, url: str, spec: Spec) -> Result:
    res = Result(spec)
    try:
        async with client.stream("POST", url + spec.path, content=spec.payload(),
                                 headers={"content-type": "application/json"}) as r:
            res.status = r.status_code
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    res.raw = json.loads(raw)
                except ValueError:
                    res.raw = raw[:300]
                if not spec.poison:
                    res.problem = f"status {r.status_code}: {raw[:300]!r}"
                elif r.status_code != 400:
                    res.problem = f"poison ({spec.poison}) got {r.status_code}, not 400: {raw[:300]!r}"
                elif not error_shape_ok(spec.anthropic, res.raw):
                    res.problem = f"poison ({spec.poison}): 400 in the wrong error shape: {raw[:300]!r}"
                return res
            events = await sse_events(r)
            if spec.poison:
                res.problem = f"poison ({spec.poison}) was accepted (200)"
                return res
            (_read_anthropic if spec.anthropic else _read_openai)(res, events)
    except Exception as e:  # noqa: BLE001 - every failure is part of the report
        res.problem = f"{type(e).__name__}: {e}"
    return res


def _client(n: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=60.0),
                             limits=httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4))


async def run_round(url: str, specs: Sequence[Spec]) -> Tuple[List[Result], float]:
    """All of `specs` at once; (results in spec order, wall seconds)."""
    async with _client(len(specs)) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(run_one(client, url, s) for s in specs))
        return list(results), time.perf_counter() - t0


async def run_solo(url: str, specs: Sequence[Spec]) -> List[Result]:
    async with _client(1) as client:
        return [await run_one(client, url, s) for s in specs]


def wait_idle(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(url + "/health", timeout=10).json()
        if h.get("active", 0) == 0 and h.get("waiting", 0) == 0:
            time.sleep(0.5)  # let the last responses and their buffers go
            return
        time.sleep(0.1)
    raise RuntimeError("the server did not go idle")


# ------------------------------------------------------------------ the whole test
def run(model: str, *, requests: int = 64, port: int = 0, poison: Optional[int] = None, seed: int = 0,
        max_concurrent: int = 8, startup_timeout: float = 120.0) -> dict:
    """Start a server on `model`, warm it up, run the load, then the solo references.
    Returns the report (see `failures` for everything that broke the contract)."""
    extra = ["--prefix-cache-mb", "0", "--max-concurrent", str(max_concurrent)]
    with ServerProcess(model, port=port, extra=extra) as srv:
        name = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        specs = build_specs(name, requests, poison=poison, seed=seed)
        rss_start = srv.rss_kb()
        warm, _ = asyncio.run(run_round(srv.url, specs))
        wait_idle(srv.url)
        rss_warm = srv.rss_kb()
        load, wall = asyncio.run(run_round(srv.url, specs))
        wait_idle(srv.url)
        rss_after = srv.rss_kb()
        good = [s for s in specs if not s.poison]
        solo = dict(zip((s.index for s in good), asyncio.run(run_solo(srv.url, good))))
        alive = srv.proc.poll() is None
        log_tail = srv.output()

    failures = []
    if len(load) != len(specs):
        failures.append(f"lost requests: sent {len(specs)}, got {len(load)} results")
    ok = rejected = 0
    for res in load:
        s = res.spec
        if res.problem:
            failures.append(f"#{s.index} {s.path}: {res.problem}")
            continue
        if s.poison:
            rejected += 1
            continue
        ref = solo[s.index]
        if ref.problem:
            failures.append(f"#{s.index} {s.path} solo run failed: {ref.problem}")
        elif (res.text, res.finish) != (ref.text, ref.finish):
            failures.append(f"#{s.index} {s.path}: batched output differs from solo: "
                            f"{res.text!r} ({res.finish}) vs {ref.text!r} ({ref.finish})")
        else:
            ok += 1
    if rss_after - rss_warm > RSS_TOLERANCE * rss_warm:
        failures.append(f"RSS after the load {rss_after} kB grew by more than {RSS_TOLERANCE:.0%} over "
                        f"{rss_warm} kB after the warm-up")
    if not alive:
        failures.append("the server died")
    tokens = sum(r.tokens for r in load if not r.spec.poison)
    finishes: dict = {}
    for r in load:
        if not r.spec.poison and r.finish:
            finishes[r.finish] = finishes.get(r.finish, 0) + 1
    report = {
        "requests": len(specs), "good": len(good), "poison": len(specs) - len(good),
        "ok": ok, "poison_rejected": rejected, "finish_reasons": finishes,
        "warmup_problems": sum(1 for r in warm if r.problem),
        "wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1) if wall else 0.0,
        "rss_start_kb": rss_start, "rss_warm_kb": rss_warm, "rss_after_kb": rss_after,
        "failures": failures,
    }
    if failures:
        report["server_log_tail"] = log_tail
    return report


def summary(r: dict) -> str:
    lines = [
        f"requests: {r['requests']} ({r['good']} good, {r['poison']} poison)",
        f"good streams ok (equal to solo): {r['ok']}/{r['good']} (finish reasons {r['finish_reasons']})",
        f"poison rejected with 400 in the API's shape: {r['poison_rejected']}/{r['poison']}",
        f"wall {r['wall_s']:.2f}s, {r['tokens']} tokens, {r['tokens_per_s']:.1f} tok/s aggregate",
        f"RSS: start {r['rss_start_kb'] / 1024:.1f} MiB, after warm-up {r['rss_warm_kb'] / 1024:.1f} MiB, "
        f"after load {r['rss_after_kb'] / 1024:.1f} MiB "
        f"({(r['rss_after_kb'] - r['rss_warm_kb']) / r['rss_warm_kb']:+.1%})",
    ]
    if r["failures"]:
        lines.append(f"FAILURES ({len(r['failures'])}):")
        lines += [f"  {f}" for f in r["failures"]]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="model folder (default: a float32 fixture model written to a temporary folder)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--poison", type=int, default=None, help="how many poison requests (default: ~10%%)")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--max-concurrent", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from mlxmtp.testing.fixtures import write_hf_checkpoint

            model = str(write_hf_checkpoint(Path(tmp) / "model", "qwen3_5"))
        report = run(model, requests=args.requests, port=args.port, poison=args.poison, seed=args.seed,
                     max_concurrent=args.max_concurrent)
    print(json.dumps(report, indent=2) if args.json else summary(report))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
