"""Concurrency benchmark: aggregate and per-request tokens/s, TTFT and inter-token
latency (p50/p95) at concurrency 1, 4, 8, 16, MTP off vs on (adaptive) and, with
`--depths`, fixed draft depths, in ONE run.

Requests are driven through the same BatchGenerator the server runs; all arrive at
once, or with `--loop N` N per slot, each slot's next request sent when its last is answered
(several agents, each waiting on its answer: the batch stays full until the round's end). As
the server does, the depth policy's costs are calibrated for one row before anything is
timed; other batch sizes learn theirs while they decode. Each round runs MTP off and on back
to back (in alternating order); the table gives medians over rounds and the range of the
per-round ratio to MTP off; with `--depths`, "on/best fixed" is adaptive's throughput over
the best of MTP off and the fixed depths in the same round. Only ratios between settings of
the same run are meaningful.

Then, for the latency of several agents at once: the longest gap in a running stream
while 1, 3 or 7 requests join it (their prefills run between its cycles).

    python bench/batch.py [--model PATH] [--max-tokens 100] [--concurrency 1,4,8,16] [--rounds 3] [--temp 0.6]
    python bench/batch.py --concurrency 4,8 --depths 1,2,3 --rounds 4 --no-joins
    python bench/batch.py --concurrency 4,8 --suffix --workload mix --no-joins
    python bench/batch.py --concurrency 4,8 --suffix --workload agents --max-tokens 300 --no-joins
    python bench/batch.py --concurrency 4 --loop 2 --suffix --workload agents --depths 3 --no-joins

`--temp`: every request samples at that temperature, seeded as the server seeds a request with a
seed (`reproducible`): every setting writes the same tokens.
`--suffix`: a setting "sfx" beside the others, adaptive with suffix drafts as `serve` runs
it, with its own "sfx/best fixed" line and "sfx/on" (suffix drafts against MTP alone).
`--workload mix`: every other request asks again for what the model wrote for its prompt
(the prompt, the model's answer, the prompt: text to copy, as an agent re-emitting what it
read); the rest are the plain prompts. `--workload agents`: every other request is a copy or
edit task on a held-out file (an Edit tool call, a file printed with a name changed:
mlxmtp/models/demo_tasks.py); the rest are the plain prompts.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.models import demo_tasks
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


def prompts_of(model, tok, workload: str, max_tokens: int):
    """The token prompts requests cycle through: the plain ones, and for "mix" after each
    one its "asked again" twin (prompt + the model's greedy answer + prompt)."""
    plain = [tok.encode(p) for p in PROMPTS]
    if workload == "plain":
        return plain
    if workload == "agents":
        tasks = demo_tasks.held_out_tasks("edit", 2) + demo_tasks.held_out_tasks("rename", 2)
        edits = [tok.encode(demo_tasks.render(tok, task, with_answer=False)) for task in tasks]
        return [p for pair in zip(plain, edits) for p in pair]
    out = []
    for p in plain:
        eng, said = BatchGenerator(model, tok, EngineConfig(enable_mtp=False)), []
        eng.submit(Request(prompt=p, max_tokens=max_tokens))
        while eng.has_work:
            said += [t for ev in eng.step() for t in ev.token_ids]
        out += [p, p + said + p]
    return out


def run(model, tok, n, max_tokens, mtp, temp=0.0, num_draft=None, prompts=None, suffix=False, loop=1):
    """One setting's round: n requests at once, or with `loop` > 1 n * loop requests n at a time,
    each answer followed by the next request (agents waiting on their answers); times per
    request from its submission."""
    eng = BatchGenerator(model, tok, EngineConfig(enable_mtp=mtp, num_draft=num_draft, max_batch=max(n, 1),
                                                  suffix_drafts=suffix))
    prompts = prompts or [tok.encode(p) for p in PROMPTS]
    t0 = time.perf_counter()
    first, last, gaps, counts, sent = {}, {}, [], {}, {}
    ids, queue = [], [Request(prompt=prompts[i % len(prompts)], max_tokens=max_tokens,
                              params=SamplingParams(temperature=temp, seed=i, reproducible=True))
                      for i in range(n * loop)][::-1]

    def submit():
        ids.append(eng.submit(queue.pop()))
        sent[ids[-1]] = time.perf_counter() - t0

    for _ in range(n):
        submit()
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
                first[rid] = now - t0 - sent[rid]
            else:
                # tokens arriving together in one cycle share the gap
                gaps += [(now - last[rid]) / len(ev.token_ids)] * len(ev.token_ids)
            last[rid] = now
            counts[rid] = counts.get(rid, 0) + len(ev.token_ids)
            if ev.finish_reason:
                stats[rid] = ev.stats.as_dict()
                if queue:
                    submit()
    wall = time.perf_counter() - t0
    total = sum(counts.values())
    per_req = [counts[r] / (last[r] - t0 - sent[r]) for r in ids]
    acc = [s["acceptance"] for s in stats.values()]
    return {
        "agg_tps": total / wall,
        "req_tps": statistics.median(per_req),
        "ttft_p50": pct(list(first.values()), 0.5), "ttft_p95": pct(list(first.values()), 0.95),
        "itl_p50": pct(gaps, 0.5), "itl_p95": pct(gaps, 0.95),
        "acceptance": statistics.mean(acc) if acc else 0.0,
        "mean_batch": statistics.mean(batch_sizes) if batch_sizes else 0,
        "answered": len(stats),
        "depth": eng.last_depth if mtp else 0,
    }


def join_gaps(model, tok, joiners, max_tokens):
    """(longest, median) seconds between a running stream's events while `joiners`
    requests join it after its first 20 tokens (MTP on)."""
    eng = BatchGenerator(model, tok, EngineConfig(max_batch=joiners + 1))
    rid = eng.submit(Request(prompt=tok.encode(PROMPTS[2]), max_tokens=max_tokens))
    last, gaps, n, joined = None, [], 0, False
    while eng.has_work:
        for ev in eng.step():
            if ev.request_id == rid and ev.token_ids:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last, n = now, n + len(ev.token_ids)
        if n >= 20 and not joined:
            joined = True
            for i in range(joiners):
                eng.submit(Request(prompt=tok.encode(PROMPTS[i % len(PROMPTS)]), max_tokens=max_tokens // 2))
    return max(gaps), statistics.median(gaps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temp", type=float, default=0.0, help="sampling temperature of every request")
    ap.add_argument("--depths", default="", help="fixed draft depths to run beside MTP off and adaptive, e.g. 1,2,3")
    ap.add_argument("--no-joins", action="store_true", help="skip the join-latency part")
    ap.add_argument("--suffix", action="store_true", help="add adaptive with suffix drafts (sfx), as serve runs")
    ap.add_argument("--loop", type=int, default=1,
                    help="requests per slot a round: each of the --concurrency requests in flight is followed by "
                         "the next as soon as it is answered, as agents send theirs (1: all at once)")
    ap.add_argument("--workload", choices=("plain", "mix", "agents"), default="plain",
                    help="mix: every other request asks again for the model's answer to its prompt; "
                         "agents: every other request is a copy or edit task on a held-out file")
    args = ap.parse_args()
    model, tok = load(args.model)
    prompts = prompts_of(model, tok, args.workload, args.max_tokens)
    BatchGenerator(model, tok).calibrate(1)  # what the server does at start-up
    if args.suffix:  # engines with suffix drafts keep a policy of their own (engine/pieces.shared_policy)
        BatchGenerator(model, tok, EngineConfig(suffix_drafts=True)).calibrate(1)
    run(model, tok, 2, 10, True)  # warm-up
    print(f"model: {args.model or 'demo'}   temp={args.temp}   max_tokens={args.max_tokens}   "
          f"rounds={args.rounds}   workload={args.workload}   loop={args.loop} (medians)")
    print(f"{'conc':>4} {'MTP':>4} {'agg tok/s':>10} {'req tok/s':>10} {'TTFT p50':>9} {'p95':>7} {'ITL p50 ms':>10} "
          f"{'p95':>7} {'accept':>7} {'batch':>6} {'on/off':>7} {'range':>10}")
    settings = {"off": (False, None, False), "on": (True, None, False)}
    if args.suffix:
        settings["sfx"] = (True, None, True)
    settings.update({f"k={k}": (True, int(k), False) for k in args.depths.split(",") if k})
    for n in [int(x) for x in args.concurrency.split(",")]:
        res = {name: [] for name in settings}
        for r in range(args.rounds):
            order = list(settings) if r % 2 == 0 else list(reversed(settings))
            for name in order:
                mtp, k, suffix = settings[name]
                res[name].append(run(model, tok, n, args.max_tokens, mtp, args.temp, k, prompts, suffix, args.loop))
        _print_rows(n, res)
    if args.no_joins:
        return
    for joiners in (1, 3, 7):
        longest, median = join_gaps(model, tok, joiners, 2 * args.max_tokens)
        print(f"a running stream while {joiners} request(s) join: longest gap {longest:.2f} s, median {median * 1e3:.0f} ms")


def _print_rows(n, res):
    """One line per setting: medians over rounds, and each setting's ratio to MTP off (and
    adaptive's to the best other setting of its round) as median and range over rounds."""
    for name, rs in res.items():
        m = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        ratio = spread = ""
        if name != "off":
            ratios = [x["agg_tps"] / off["agg_tps"] for x, off in zip(rs, res["off"])]
            ratio, spread = f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}"
        print(f"{n:4} {name:>4} {m['agg_tps']:10.1f} {m['req_tps']:10.1f} {m['ttft_p50']:9.3f} {m['ttft_p95']:7.3f} "
              f"{m['itl_p50'] * 1e3:10.1f} {m['itl_p95'] * 1e3:7.1f} {m['acceptance']:7.2f} {m['mean_batch']:6.1f} "
              f"{ratio:>7} {spread:>10}")
    for mine in ("on", "sfx"):
        others = [name for name in res if name not in ("on", "sfx")]
        if mine not in res or len(others) < 2:
            continue
        best = [max(res[name][r]["agg_tps"] for name in others) for r in range(len(res[mine]))]
        vs_best = [x["agg_tps"] / b for x, b in zip(res[mine], best)]
        print(f"{n:4} {mine}/best fixed {statistics.median(vs_best):.2f}x (range {min(vs_best):.2f}-{max(vs_best):.2f})")
    if "sfx" in res:
        vs_on = [x["agg_tps"] / on["agg_tps"] for x, on in zip(res["sfx"], res["on"])]
        print(f"{n:4} sfx/on {statistics.median(vs_on):.2f}x (range {min(vs_on):.2f}-{max(vs_on):.2f})")


if __name__ == "__main__":
    main()
