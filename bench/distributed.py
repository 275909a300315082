"""1 rank against 2 ranks (`mlxmtp launch --backend ring -n 2`: MLX's launcher), MTP off, on,
and on with suffix drafts beside the head (serve's default): decode tokens/s and what each
cycle spends communicating.

Each setting decodes the same prompts (greedy, one request at a time; the first request
of each setting warms up and is not counted). Communication per cycle has two parts:
  - control: rank 0's step messages and depth decisions (distributed/channel.py), timed
    as they run, waiting for the other rank included;
  - hidden states: mlx-lm's pipeline passes [1, T, hidden] from rank to rank and
    all-gathers them once per forward. They sit inside the forward's graph, so they are
    timed apart: the same send/recv/all-gather of T = 1 and T = k+1 tokens, alone.
On one machine both ranks share its cores, so 2 ranks are slower than 1 here; the
numbers that carry over to two machines are the bytes and counts per cycle.

    python bench/distributed.py                    # demo model, 2 ranks on loopback
    python bench/distributed.py --model PATH --max-tokens 64 --markdown
    python bench/distributed.py --on-paper         # the two-Mac-Studio table of docs/across-machines.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

from mlxmtp.engine.config import EngineConfig
from mlxmtp.models.demo import demo_model_path
from mlxmtp.models.demo_prompts import HELD_OUT_PROMPTS

SETTINGS = {"MTP off": EngineConfig(enable_mtp=False), "MTP adaptive": EngineConfig(enable_mtp=True),
            "adaptive, suffix": EngineConfig(enable_mtp=True, suffix_drafts=True)}
TRANSFER_WIDTHS = (1, 2, 3, 4, 5, 9, 17, 33)  # tokens per hand-over timed: plain, the head's depths, suffix ones


def decode(engine_for, tok, prompts, max_tokens):
    """-> (tokens/s over the counted requests, cycles, tokens); `engine_for()` a fresh engine."""
    from mlxmtp.engine.generate import generate

    ids = [tok.encode(p) for p in prompts]  # code to continue, as bench/decode.py feeds the demo model
    tokens = seconds = cycles = 0
    for i, p in enumerate(ids):  # the first warms up
        engine = engine_for()
        res = generate(None, tok, p, max_tokens=max_tokens, engine=engine)
        engine.close()  # a distributed engine releases the other rank (engine/interface.Engine)
        if i > 0:
            tokens += res.stats.decode_tokens
            seconds += res.stats.decode_seconds
            cycles += res.stats.forwards
    return tokens / seconds, cycles, tokens


def transfer_ms(group, hidden, T, dtype, reps=50):
    """ms of one pipeline hand-over of T tokens between 2 ranks: send/recv, then all-gather."""
    h = mx.zeros((1, T, hidden), dtype=dtype)

    def once():
        if group.rank() == 1:
            x = mx.distributed.send(h, 0, group=group)
        else:
            x = mx.distributed.recv_like(h, 1, group=group)
        mx.eval(mx.distributed.all_gather(x, group=group))

    for _ in range(5):
        once()
    t = time.perf_counter()
    for _ in range(reps):
        once()
    return (time.perf_counter() - t) / reps * 1e3


def worker(args):
    """One rank of the 2-rank run; rank 0 prints the results as one JSON object."""
    from mlxmtp.distributed.engine import DistributedEngine
    from mlxmtp.distributed.group import launched_group
    from mlxmtp.distributed.load import load_on_rank

    group = launched_group()
    model, tok, _ = load_on_rank(group, args.model, EngineConfig())
    prompts = list(HELD_OUT_PROMPTS.values())[: args.prompts + 1]
    out = {}
    for name, config in SETTINGS.items():
        engines = []

        def engine_for(engines=engines, config=config):
            engines.append(DistributedEngine(model, tok, config, group=group))
            return engines[-1]

        if group.rank() > 0:
            for _ in range(len(prompts)):
                engine_for().follow()
            continue
        rate, cycles, tokens = decode(engine_for, tok, prompts, args.max_tokens)
        counted = engines[1:]
        control = sum(e.channel.seconds for e in counted)
        out[name] = dict(rate=rate, cycles=cycles, tokens=tokens, control_ms=control / max(cycles, 1) * 1e3,
                         control_bytes=sum(e.channel.bytes_sent for e in counted) / max(cycles, 1))
    hidden = model.parts.args.hidden_size
    dtype = model.parts.embed_tokens.weight.dtype
    transfers = {T: transfer_ms(group, hidden, T, dtype) for T in TRANSFER_WIDTHS}
    if group.rank() == 0:
        print(json.dumps({"two_ranks": out, "transfer_ms": transfers, "hidden": hidden,
                          "itemsize": dtype.size}), flush=True)


def one_rank(args):
    from mlxmtp.engine.batch import BatchGenerator
    from mlxmtp.models.load import load

    model, tok = load(args.model)
    prompts = list(HELD_OUT_PROMPTS.values())[: args.prompts + 1]
    out = {}
    for name, config in SETTINGS.items():
        rate, cycles, tokens = decode(lambda config=config: BatchGenerator(model, tok, config), tok, prompts,
                                      args.max_tokens)
        out[name] = dict(rate=rate, cycles=cycles, tokens=tokens)
    return out


def launch(cmd, timeout=None, env=None) -> subprocess.CompletedProcess:
    """Run an `mlxmtp launch` command line, capturing its output (plain mlx.launch would keep
    one of the two cores the ranks share busy: docs/across-machines.md)."""
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=timeout)


def launch_two_ranks(args):
    here = Path(__file__).resolve()
    cmd = [str(Path(sys.executable).parent / "mlxmtp"), "launch", "--backend", "ring", "-n", "2", "--",
           sys.executable, str(here), "--worker", "--model", args.model, "--prompts", str(args.prompts),
           "--max-tokens", str(args.max_tokens)]
    res = launch(cmd)
    if res.returncode != 0:
        raise SystemExit(f"the 2-rank run failed:\n{res.stderr[-3000:]}")
    return json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])


def report(one, two, markdown):
    rows = []
    for name in SETTINGS:
        a, b = one[name], two["two_ranks"][name]
        per_cycle = b["tokens"] / max(b["cycles"], 1)
        # The narrowest measured hand-over that holds a cycle's typical tokens (a verify of k + 1).
        T = 1 if name == "MTP off" else min((t for t in TRANSFER_WIDTHS if t >= round(per_cycle + 0.5)),
                                            default=TRANSFER_WIDTHS[-1])
        rows.append((name, f"{a['rate']:.1f}", f"{b['rate']:.1f}", f"{b['rate'] / a['rate']:.2f}x",
                     f"{per_cycle:.2f}", f"{b['control_ms']:.2f}", f"{b['control_bytes']:.0f}",
                     f"{two['transfer_ms'][str(T)]:.2f} (T={T})"))
    head = ("setting", "1 rank tok/s", "2 ranks tok/s", "2 vs 1", "tokens/cycle", "control ms/cycle",
            "control bytes/cycle", "hidden-state hand-over ms")
    if markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        for r in rows:
            print(dict(zip(head, r)))
    print(f"hidden {two['hidden']} x {two['itemsize']} bytes: one hand-over of T tokens moves "
          f"{two['hidden'] * two['itemsize']}*T bytes rank to rank, then all-gathers them")


# The on-paper case of docs/across-machines.md: Qwen3.5-397B-A17B at 8 bits on two M3 Ultra Mac Studios.
PAPER = dict(active_gb=18.0, bandwidth_gbs=819.0, efficiency=0.7, hidden=4096, act_bytes=2,
             routed_share=7.5 / 17, draft_step=0.075, first_accept=0.85, next_accept=0.8,
             link_gbs=10.0, latency_us={"JACCL": 10.0, "ring": 100.0}, collectives=3, control_bytes=100,
             tp_allreduces=120)


def on_paper(p=PAPER):
    """Print the table: per depth k, bytes and link time per cycle, expected tokens per
    cycle, cycle cost relative to plain decoding, tokens/s of the pipeline split."""
    step_ms = p["active_gb"] / (p["bandwidth_gbs"] * p["efficiency"]) * 1e3
    print(f"plain step {step_ms:.1f} ms")
    print("| k | bytes/cycle | link ms JACCL / ring | tokens/cycle | cost vs plain | tok/s JACCL / ring | speed-up JACCL / ring |")
    print("|---|---|---|---|---|---|---|")
    base = {}
    for k in range(5):
        T = k + 1
        moved = 3 * T * p["hidden"] * p["act_bytes"] + p["control_bytes"]
        link = {n: p["collectives"] * us / 1e3 + moved / (p["link_gbs"] * 1e9) * 1e3 for n, us in p["latency_us"].items()}
        tokens = 1 + sum(p["first_accept"] * p["next_accept"] ** i for i in range(k))
        cost = 1 + p["routed_share"] * (T - 1) + p["draft_step"] * k
        rate = {n: tokens / (cost * step_ms + ms) * 1e3 for n, ms in link.items()}
        base = base or rate
        print(f"| {k} | {moved / 1024:.0f} KiB | {link['JACCL']:.2f} / {link['ring']:.2f} | {tokens:.2f} | "
              f"{cost:.2f} | {rate['JACCL']:.0f} / {rate['ring']:.0f} | "
              f"{rate['JACCL'] / base['JACCL']:.2f}x / {rate['ring'] / base['ring']:.2f}x |")
    for n, us in p["latency_us"].items():
        comm = p["tp_allreduces"] * us / 1e3
        plain = 1e3 / (step_ms / 2 + comm)
        k2 = (1 + p["first_accept"] + p["first_accept"] * p["next_accept"])
        mtp = k2 / ((1 + 2 * p["routed_share"] + 2 * p["draft_step"]) * step_ms / 2 + comm) * 1e3
        print(f"tensor parallel, {n}: {comm:.1f} ms of all-reduces per forward; {plain:.0f} tok/s plain, "
              f"{mtp:.0f} with MTP at k=2")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(demo_model_path()))
    ap.add_argument("--prompts", type=int, default=3, help="counted prompts (one more warms up)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--on-paper", action="store_true", help="print the two-machine estimate of docs/across-machines.md and exit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.on_paper:
        return on_paper()
    if args.worker:
        return worker(args)
    two = launch_two_ranks(args)  # first, while this process has not loaded MLX's threads
    report(one_rank(args), two, args.markdown)


if __name__ == "__main__":
    main()
