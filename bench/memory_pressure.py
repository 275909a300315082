"""Requests that outgrow the server's memory: paused and resumed, never wrong, never down.

Two `mlxmtp serve` processes on the same model: one unbounded, one with `--memory-mb`
small enough that the concurrent requests outgrow it while they decode. The same greedy
completions run one by one on the first and all at once on the second; the second's
outputs must be the same, and its /metrics say how many requests were sent back to wait
(engine/memory.py).

    python bench/memory_pressure.py                       # demo model, 3 requests, 4 MiB
    python bench/memory_pressure.py --model PATH --memory-mb 2048 --max-tokens 4000
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import subprocess
import sys
import time

import httpx

from mlxmtp.models.demo_prompts import HELD_OUT_PROMPTS


def start(port: int, model, extra) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mlxmtp.commands", "serve", "--port", str(port), *(["--model", model] if model else []),
           *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).raise_for_status()
            return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server on port {port} did not start")


def complete(port: int, prompt: str, max_tokens: int) -> str:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=3600,
                   json={"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def metric(port: int, name: str) -> float:
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the demo model")
    ap.add_argument("--memory-mb", type=int, default=4)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=1500)
    args = ap.parse_args()
    prompts = (list(HELD_OUT_PROMPTS.values()) * args.requests)[: args.requests]
    free = start(8181, args.model, [])
    tight = start(8182, args.model, ["--memory-mb", str(args.memory_mb)])
    try:
        t = time.perf_counter()
        alone = [complete(8181, p, args.max_tokens) for p in prompts]
        t_alone = time.perf_counter() - t
        t = time.perf_counter()
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: complete(8182, p, args.max_tokens), prompts))
        t_together = time.perf_counter() - t
        preempted = metric(8182, "mlxmtp_memory_preempted_requests")
    finally:
        free.terminate()
        tight.terminate()
    same = sum(a == b for a, b in zip(alone, together, strict=True))
    print("| setting | requests | max_tokens | wall s | sent back to wait | outputs equal to unbounded |")
    print("|---|---|---|---|---|---|")
    print(f"| unbounded, one by one | {len(prompts)} | {args.max_tokens} | {t_alone:.1f} | | |")
    print(f"| --memory-mb {args.memory_mb}, all at once | {len(prompts)} | {args.max_tokens} | {t_together:.1f} "
          f"| {preempted:.0f} | {same}/{len(prompts)} |")


if __name__ == "__main__":
    main()
