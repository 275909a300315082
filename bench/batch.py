"""Concurrency benchmark: aggregate and per-request tokens/s, TTFT and inter-token
latency (p50/p95) at concurrency 1, 4, 8, 16, MTP off vs on, in ONE run.

Requests are driven through the same BatchGenerator the server runs; all arrive at
once. Only ratios between settings of the same run are meaningful.

    python bench/batch.py [--model PATH] [--max-tokens 100] [--concurrency 1,4,8,16]
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.request import Request
from mlxmtp.models.load import load

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "with open(path) as f:\n    for line in f:\n",
]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def run(model, tok, n, max_tokens, mtp):
    eng = BatchGenerator(model, tok, enable_mtp=mtp, max_batch=max(n, 1))
    t0 = time.perf_counter()
    first, last, gaps, counts = {}, {}, [], {}
    ids = []
    for i in range(n):
        ids.append(eng.submit(Request(prompt=tok.encode(PROMPTS[i % len(PROMPTS)]), max_tokens=max_tokens)))
    batch_sizes, stats = [], {}
    while eng.has_work:
        evs = eng.step()
        now = time.perf_counter()
        batch_sizes.append(eng.num_active)
        for ev in evs:
            if not ev.token_ids:
                continue
            rid = ev.request_id
            if rid not in first:
                first[rid] = now - t0
            else:
                # tokens arriving together in one cycle share the gap
                gaps += [(now - last[rid]) / len(ev.token_ids)] * len(ev.token_ids)
            last[rid] = now
            counts[rid] = counts.get(rid, 0) + len(ev.token_ids)
            if ev.finish_reason:
                stats[rid] = ev.stats.as_dict()
    wall = time.perf_counter() - t0
    total = sum(counts.values())
    per_req = [counts[r] / (last[r] - t0) for r in ids]
    acc = [s["acceptance"] for s in stats.values()]
    return {
        "agg_tps": total / wall,
        "req_tps": statistics.median(per_req),
        "ttft_p50": pct(list(first.values()), 0.5), "ttft_p95": pct(list(first.values()), 0.95),
        "itl_p50": pct(gaps, 0.5), "itl_p95": pct(gaps, 0.95),
        "acceptance": statistics.mean(acc) if acc else 0.0,
        "mean_batch": statistics.mean(batch_sizes) if batch_sizes else 0,
        "depth": eng.last_depth if mtp else 0,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--concurrency", default="1,4,8,16")
    args = ap.parse_args()
    model, tok = load(args.model)
    run(model, tok, 2, 10, True)  # warm-up
    print(f"model: {args.model or 'demo'}   max_tokens={args.max_tokens}")
    print(f"{'conc':>4} {'MTP':>4} {'agg tok/s':>10} {'req tok/s':>10} {'TTFT p50':>9} {'p95':>7} {'ITL p50 ms':>10} {'p95':>7} {'accept':>7} {'batch':>6} {'on/off':>7}")
    for n in [int(x) for x in args.concurrency.split(",")]:
        off = run(model, tok, n, args.max_tokens, False)
        on = run(model, tok, n, args.max_tokens, True)
        for name, r in (("off", off), ("on", on)):
            ratio = f"{on['agg_tps'] / off['agg_tps']:.2f}x" if name == "on" else ""
            print(f"{n:4} {name:>4} {r['agg_tps']:10.1f} {r['req_tps']:10.1f} {r['ttft_p50']:9.3f} {r['ttft_p95']:7.3f} "
                  f"{r['itl_p50'] * 1e3:10.1f} {r['itl_p95'] * 1e3:7.1f} {r['acceptance']:7.2f} {r['mean_batch']:6.1f} {ratio:>7}")


if __name__ == "__main__":
    main()
