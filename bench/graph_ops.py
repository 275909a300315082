"""Operations evaluated per generated token: what each setting launches on a GPU.

On a GPU each operation MLX evaluates is one kernel launch, built and encoded by the
host; for a small model that is much of a decode step's cost (see
mlxmtp/testing/graph_ops.py). This counts them exactly, on any backend, for mlx-lm's
own decoding, MTP off, adaptive depth and fixed depths (with and without compiled head
steps), over the demo's prompts:
- ops/token: every operation evaluated after the first token, per token emitted;
- mlx-lm / ours: how much fewer operations per token than mlx-lm (above 1: fewer), the
  speed-up a decode bound by launches alone could reach;
- per cycle: the head's drafts, the verify forward with its acceptance (and, in plain
  decoding, the forward), and tokens emitted per cycle;
- four sampled requests decoding together, per cycle, for temperature alone, with top-p
  and top-k, and with a repetition penalty (a logits processor: decided row by row).
Counts are deterministic for greedy fixed settings; adaptive depth follows this machine's
timings. On the CPU the `mx.fast` ops run as their fallback ops (one kernel each on a GPU).

    python bench/graph_ops.py                      # demo model, greedy and temperature 0.6
    python bench/graph_ops.py --model PATH --temps 0 --max-tokens 100
"""

from __future__ import annotations

import argparse
import tempfile

import mlx.core as mx
import mlx_lm
from decode import PROMPTS, model_path
from mlx_lm.sample_utils import make_sampler

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.generate import stream_generate
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.models.load import load
from mlxmtp.testing.graph_ops import OpCounter

# (label, engine options); None: mlx-lm's own decoding
SETTINGS = [("mlx-lm generate", None), ("MTP off", {"enable_mtp": False}), ("adaptive", {})] + [
    (f"k={k}", {"num_draft": k}) for k in (1, 2, 3, 4)] + [
    (f"k={k} compiled", {"num_draft": k, "shape_stable": True, "compile_steps": True}) for k in (2, 3, 4)]
DRAFT_SITES = ("_propose",)  # where the engine queues the drafts (BatchGenerator._propose)
VERIFY_SITES = ("evaluate", "start")  # a synchronous cycle's evaluation; a pipelined one's


def count_mlx_lm(model, tok, prompt, n, temp, seed):
    """(ops, tokens, cycles, depths) of mlx-lm's stream_generate after its first token."""
    mx.random.seed(seed)
    got = 0
    with OpCounter() as ops:
        for i, _ in enumerate(mlx_lm.stream_generate(model, tok, prompt, max_tokens=n + 1,
                                                     sampler=make_sampler(temp=temp))):
            if i == 0:
                ops.reset()
            else:
                got += 1
    return ops, got, got, {}


def count_engine(model, tok, prompt, n, temp, seed, options):
    """The same for one request on the engine the server runs, with engine `options`."""
    engine = BatchGenerator(model, tok, EngineConfig(**{"enable_mtp": True, **options}))
    engine.calibrate(1)  # the server calibrates at start-up, before any request
    got, cycles, stats = 0, engine.cycles, None
    with OpCounter() as ops:
        for i, ev in enumerate(stream_generate(model, tok, prompt, max_tokens=n + 1, engine=engine,
                                               params=SamplingParams(temperature=temp, seed=seed))):
            if i == 0:
                ops.reset()
                cycles = engine.cycles
            else:
                got += len(ev.token_ids)
            stats = ev.stats or stats
    return ops, got, engine.cycles - cycles, stats.depths


def run_setting(model, tok, prompts, n, temp, options):
    """Totals over the prompts -> {ops, draft, verify, tokens, cycles, depths}."""
    tot = {"ops": 0, "draft": 0, "verify": 0, "tokens": 0, "cycles": 0, "depths": {}}
    for seed, prompt in enumerate(prompts):
        if options is None:
            ops, got, cycles, depths = count_mlx_lm(model, tok, prompt, n, temp, seed)
        else:
            ops, got, cycles, depths = count_engine(model, tok, prompt, n, temp, seed, options)
        tot["ops"] += ops.kernels
        tot["draft"] += sum(ops.by_site[s] for s in DRAFT_SITES)
        tot["verify"] += sum(ops.by_site[s] for s in VERIFY_SITES)
        tot["tokens"] += got
        tot["cycles"] += cycles
        for k, c in depths.items():
            tot["depths"][k] = tot["depths"].get(k, 0) + c
    return tot


# Sampled batches (every row with the same settings, as agents sharing a client's): the
# operations of a cycle, drafting and deciding all rows.
BATCH_PARAMS = [("temperature 0.7", {"temperature": 0.7}),
                ("temperature 0.7, top_p 0.95, top_k 20", {"temperature": 0.7, "top_p": 0.95, "top_k": 20}),
                ("temperature 0.7, repetition_penalty 1.1", {"temperature": 0.7, "repetition_penalty": 1.1}),
                # a seeded request as the server makes it (engine/sampling/seeded.py)
                ("temperature 0.7, reproducible seed", {"temperature": 0.7, "reproducible": True})]


def batch_ops_per_cycle(model, tok, prompts, rows, params, k, steps=20):
    """Operations per decode cycle of `rows` requests decoding together at depth k (0: MTP
    off), counted over `steps` engine steps once all have started."""
    engine = BatchGenerator(model, tok, EngineConfig(enable_mtp=k > 0, num_draft=k or None))
    for b in range(rows):
        engine.submit(Request(prompt=prompts[b % len(prompts)], max_tokens=steps * (k + 1) + 20,
                              params=SamplingParams(**params, seed=b)))
    while len(engine.rows) < rows:
        engine.step()
    with OpCounter() as ops:
        start = engine.cycles
        for _ in range(steps):
            engine.step()
    return ops.kernels / (engine.cycles - start)


def report_batches(model, tok, prompts, rows=4):
    print(f"\n{rows} sampled requests at once: operations per cycle")
    print("| settings | MTP off | k=3 |")
    print("|---|---|---|")
    for label, params in BATCH_PARAMS:
        off, k3 = (batch_ops_per_cycle(model, tok, prompts, rows, params, k) for k in (0, 3))
        print(f"| {label} | {off:.0f} | {k3:.0f} |")


def report(model, tok, prompts, n, temps):
    print(f"device: {mx.default_device()}   prompts: {len(prompts)}   tokens each: {n}")
    for temp in temps:
        print(f"\ntemperature {temp}")
        print("| setting | ops/token | mlx-lm / ours | tokens/cycle | draft ops/cycle | verify ops/cycle |")
        print("|---|---|---|---|---|---|")
        base = None
        for label, options in SETTINGS:
            t = run_setting(model, tok, prompts, n, temp, options)
            per_token = t["ops"] / t["tokens"]
            base = base or per_token
            cycles = max(t["cycles"], 1)
            depths = ", ".join(f"{k}:{c}" for k, c in sorted(t["depths"].items()))
            name = f"{label} ({depths})" if label == "adaptive" else label
            cyc = "" if options is None else f"{t['tokens'] / cycles:.2f}"
            draft = "" if options is None else f"{t['draft'] / cycles:.0f}"
            verify = "" if options is None else f"{t['verify'] / cycles:.0f}"
            print(f"| {name} | {per_token:.0f} | {base / per_token:.2f}x | {cyc} | {draft} | {verify} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo", help='"demo", "demo-4bit", or a path or Hub id')
    ap.add_argument("--temps", default="0,0.6")
    ap.add_argument("--max-tokens", type=int, default=100)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = load(model_path(args.model, tmp)[0])
        prompts = [tok.encode(p) for p in PROMPTS]
        report(model, tok, prompts, args.max_tokens, [float(t) for t in args.temps.split(",")])
        report_batches(model, tok, prompts)


if __name__ == "__main__":
    main()
