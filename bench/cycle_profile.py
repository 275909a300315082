"""Where a decode cycle's time goes, depth by depth: host graph building vs device time.

For each depth k (0 = plain decoding, pipelined: its "finish" includes the wait for the
device) one request is decoded with the engine's profiling on, and each cycle is
split into: building the drafts' graph, waiting for the drafts, building the verify's
graph, waiting for the verify (device), and reading + rolling back + emitting (host).
Then a shape check: the first request of prompts of lengths never seen before against a
second run of the same prompt (a backend that compiles kernels per shape pays on the
first only), and the host/device split of single forwards of T = 1..5 tokens.

    python bench/cycle_profile.py                 # demo model
    python bench/cycle_profile.py --model PATH --max-tokens 100
    python bench/cycle_profile.py --compile-steps  # the head's steps and the accept step compiled
    python bench/cycle_profile.py --temp 0.6       # sampled: the draft and accept steps of sampled rows
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_sampler

from mlxmtp.engine import batch as batch_mod
from mlxmtp.engine import cycle
from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.generate import generate
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.mlxlm import adapter
from mlxmtp.models.demo import demo_model_path
from mlxmtp.models.demo_prompts import HELD_OUT_PROMPTS
from mlxmtp.models.load import load
from mlxmtp.testing.graph_ops import OpCounter

PARTS = ("draft build", "draft wait", "verify build", "verify wait", "finish", "other")


def instrument(times):
    """Wrap the engine's steps so each cycle's parts add up in `times` (seconds)."""
    orig_draft, orig_verify, orig_eval = batch_mod.draft, cycle.verify, cycle.evaluate
    orig_finish = BatchGenerator._finish

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            times[name] += time.perf_counter() - t
            return out
        return wrapper

    batch_mod.draft = timed("draft build", orig_draft)
    cycle.verify = timed("verify build", orig_verify)
    cycle.evaluate = timed("verify wait", orig_eval)
    BatchGenerator._finish = timed("finish", orig_finish)

    def undo():
        batch_mod.draft, cycle.verify, cycle.evaluate = orig_draft, orig_verify, orig_eval
        BatchGenerator._finish = orig_finish
    return undo


def profile_depth(model, tok, prompt, k, max_tokens, compile_steps=False, temp=0.0):
    """One request at depth k (sampled at `temp`) -> {part: ms per cycle}, tokens per cycle, tok/s."""
    times = {p: 0.0 for p in PARTS if p != "other"}
    engine = BatchGenerator(model, tok, EngineConfig(enable_mtp=True, num_draft=k, profile=True,
                                                     compile_steps=compile_steps))
    undo = instrument(times)
    try:
        t = time.perf_counter()
        res = generate(model, tok, prompt, max_tokens=max_tokens, engine=engine,
                       params=SamplingParams(temperature=temp, seed=0))
        wall = time.perf_counter() - t - res.stats.prefill_seconds
    finally:
        undo()
    times["draft wait"] = res.stats.draft_seconds
    times["other"] = wall - sum(times.values())
    cycles = max(1, engine.cycles)
    per = {p: 1e3 * v / cycles for p, v in times.items()}
    return per, len(res.token_ids) / cycles, len(res.token_ids) / wall


def host_device_split(model, sizes=(1, 2, 3, 4, 5), context=128, reps=20):
    """T -> (median ms to build one T-token forward's graph, to evaluate it, the operations
    it evaluates: counted in an extra untimed forward)."""
    parts = model.parts
    cache = adapter.make_cache(parts, 1)
    mx.eval(adapter.forward(parts, mx.zeros((1, context), mx.int32), cache)[0])
    out = {}
    for T in sizes:
        with OpCounter() as ops:
            mx.eval(adapter.forward(parts, mx.zeros((1, T), mx.int32), cache)[0], *cache.arrays())
        cache.trim_rows([T])
        build, run = [], []
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            logits, _ = adapter.forward(parts, mx.zeros((1, T), mx.int32), cache)
            t1 = time.perf_counter()
            mx.eval(logits, *cache.arrays())
            t2 = time.perf_counter()
            cache.trim_rows([T])
            build.append(t1 - t0)
            run.append(t2 - t1)
        out[T] = (1e3 * statistics.median(build[2:]), 1e3 * statistics.median(run[2:]), ops.kernels)
    return out


def new_lengths(model, tok, k, lengths, max_tokens, compile_steps=False):
    """tok/s of the first and the second run of prompts of never-seen lengths."""
    base = tok.encode(" ".join(HELD_OUT_PROMPTS.values()) * 2)
    rows = []
    for n in lengths:
        prompt = base[:n]
        config = EngineConfig(num_draft=k, compile_steps=compile_steps)
        first = generate(model, tok, prompt, max_tokens=max_tokens, config=config).stats
        second = generate(model, tok, prompt, max_tokens=max_tokens, config=config).stats
        rows.append((n, first.decode_tokens / first.decode_seconds, second.decode_tokens / second.decode_seconds))
    return rows


def mlx_lm_speed(ref, tok, prompt, max_tokens, temp=0.0):
    n, first = 0, None
    for _ in mlx_lm.stream_generate(ref, tok, prompt, max_tokens=max_tokens, sampler=make_sampler(temp=temp)):
        n += 1
        if first is None:
            first = time.perf_counter()
    return (n - 1) / (time.perf_counter() - first)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--depths", default="0,1,2,3,4")
    ap.add_argument("--compile-steps", action="store_true")
    ap.add_argument("--temp", type=float, default=0.0, help="sampling temperature of the profiled requests")
    args = ap.parse_args()
    compiled, temp = args.compile_steps, args.temp
    path = args.model or str(demo_model_path())
    model, tok = load(path)
    ref, _ = mlx_lm.load(path)
    prompt = tok.encode(next(iter(HELD_OUT_PROMPTS.values())))
    depths = [int(d) for d in args.depths.split(",")]
    for k in depths:  # warm-up
        profile_depth(model, tok, prompt, k, 20, compiled, temp)
    mlx_lm_speed(ref, tok, prompt, 20, temp)
    print(f"device: {mx.default_device()}   temp {temp}   "
          f"mlx-lm: {mlx_lm_speed(ref, tok, prompt, args.max_tokens, temp):.1f} tok/s"
          + ("   (compile_steps)" if compiled else ""))
    print("| k | " + " | ".join(PARTS) + " | ms/cycle | tok/cycle | ms/token | tok/s |")
    print("|---" * (len(PARTS) + 5) + "|")
    for k in depths:
        per, tpc, tps = profile_depth(model, tok, prompt, k, args.max_tokens, compiled, temp)
        total = sum(per.values())
        print(f"| {k} | " + " | ".join(f"{per[p]:.2f}" for p in PARTS)
              + f" | {total:.2f} | {tpc:.2f} | {total / tpc:.2f} | {tps:.1f} |")
    print("\none forward of T tokens at 128 context: ms to build its graph / to evaluate it, the operations")
    print("it evaluates (one kernel launch each on a GPU) and microseconds of evaluation per operation")
    for T, (b, r, n) in host_device_split(model).items():
        print(f"  T={T}: build {b:.2f} ms, evaluate {r:.2f} ms, {n} operations, {1e3 * r / n:.2f} us per operation")
    print("\nfirst vs second run of never-seen prompt lengths (tok/s)")
    for k in [d for d in depths if d][:2]:
        for n, a, b in new_lengths(model, tok, k, (37, 151, 389), 40, compiled):
            print(f"  k={k} len={n}: first {a:.1f}, second {b:.1f} ({a / b:.2f}x)")


if __name__ == "__main__":
    main()
