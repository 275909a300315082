"""Helpers for the server tests: a real uvicorn server in a thread, a test-only
request hook that forces the (random) fixture model's output, and bench/load.py (its
`mlxmtp serve` subprocess starter) as a module. conftest.py builds its fixtures on these.

The forced output is a logits processor added to the request's SamplingParams: the
engine still runs everything for real (prefill, MTP drafts, verify, acceptance, stop
on EOS, detokenization) but every distribution is a one-hot on the scripted token, so
tool-call / thinking parsing can be checked end to end through HTTP.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import uvicorn

from mlxmtp.engine.config import EngineConfig
from mlxmtp.server.config import SERVED_ENGINE

EOS_ID = 298  # <|im_end|> in the fixture tokenizer
BENCH = Path(__file__).resolve().parents[1] / "bench"


def served_engine(**fields) -> EngineConfig:
    """The engine create_app runs by default (server.config.SERVED_ENGINE) with `fields` changed."""
    return dataclasses.replace(SERVED_ENGINE, **fields)


def load_bench_module(name: str = "load"):
    """bench/NAME.py as the module `bench_NAME` (by default bench/load.py: ServerProcess,
    the load generator)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


free_port = load_bench_module().free_port  # a free local port: bench/load.py's, which starts servers too


class ServerThread:
    """A uvicorn server for `app` on a free local port, as a context manager; `state` is
    the app's ServerState."""

    def __init__(self, app):
        self.port = free_port()
        self.app = app
        self.state = app.state.server
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def forced_processor(prompt_len: int, ids):
    """Logits processor: position i of the output is ids[i] (EOS afterwards)."""

    def proc(ctx, logits):
        i = int(ctx.shape[0]) - prompt_len
        target = ids[i] if 0 <= i < len(ids) else EOS_ID
        vocab = logits.shape[-1]
        row = mx.where(mx.arange(vocab) == target, 0.0, -1e9).astype(logits.dtype)
        return mx.broadcast_to(row, logits.shape)

    return proc


def failing_processor(ctx, logits):
    raise RuntimeError("injected failure")


class Hook:
    """request_hook for create_app: a marker anywhere in the request body picks a script.

    `FORCE:<name>` forces SCRIPTS[name] (+ EOS); `FAIL:now` makes the engine step raise."""

    def __init__(self, tok, scripts=None):
        self.tok = tok
        self.scripts = dict(scripts or {})

    def __call__(self, req, body):
        raw = json.dumps(body)
        if "FAIL:now" in raw:
            req.params.logits_processors.append(failing_processor)
            return
        for name, text in sorted(self.scripts.items(), key=lambda kv: -len(kv[0])):  # longest name first
            if f"FORCE:{name}" in raw:
                ids = self.tok.encode(text, add_special_tokens=False) + [EOS_ID]
                # First: what the server adds (a thinking budget) acts on the scripted
                # model's logits as it would on a real model's.
                req.params.logits_processors.insert(0, forced_processor(len(req.prompt), ids))
                return


def streams_solo_and_together(url: str, model: str, prompts, max_tokens: int):
    """Each prompt streamed greedily alone, one after another, then all at once ->
    (solo texts, together texts): batching must not change a request's output."""
    import asyncio

    import openai

    async def one(client, p):
        s = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                                 max_tokens=max_tokens, temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])

    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        solo = [await one(client, p) for p in prompts]
        return solo, list(await asyncio.gather(*(one(client, p) for p in prompts)))

    return asyncio.run(main())
