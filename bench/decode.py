"""Single-request decode benchmark: mlx-lm vs mlxmtp (MTP off, k = 1..4, adaptive).

All settings run in ONE process, interleaved round by round, so machine noise hits
them alike; only ratios are meaningful. Also measures the cost of a (k+1)-token
forward relative to a 1-token forward, from which the ideal speedup of depth k is
    ideal(k) = tokens_per_forward(k) / cost(k+1 tokens) * cost(1 token)
and measured/ideal is the engine's efficiency (draft cost and overhead included).

    python bench/decode.py [--model PATH] [--max-tokens 200] [--rounds 3] [--temp 0.0]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_sampler

from mlxmtp.engine import mlx_lm_adapter as adapter
from mlxmtp.engine.generate import stream_generate
from mlxmtp.engine.sampling import SamplingParams
from mlxmtp.models.demo import demo_model_path
from mlxmtp.models.load import load

PROMPT = '''def _parse_args(argv):
    """Parse command line arguments for the tool."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", help="input file")
'''


def forward_cost(model, T, context=128, reps=20):
    """Seconds for one T-token forward at `context` tokens of cache (median)."""
    parts = model.mtp.parts
    times = []
    for _ in range(reps):
        cache = adapter.make_cache(parts, 1)
        adapter.forward(parts, mx.zeros((1, context), mx.int32), cache)
        mx.eval([a for c in cache for a in ([c.keys, c.values] if hasattr(c, "lengths") and not hasattr(c, "cache") else c.cache)])
        t0 = time.perf_counter()
        logits, _ = adapter.forward(parts, mx.zeros((1, T), mx.int32), cache)
        mx.eval(logits)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_mlx_lm(ref, tok, prompt, n, temp, seed):
    """Tokens/s after the first token, by wall clock (the same method for every setting)."""
    mx.random.seed(seed)
    count, t_first = 0, None
    for resp in mlx_lm.stream_generate(ref, tok, prompt, max_tokens=n, sampler=make_sampler(temp=temp)):
        count = resp.generation_tokens
        if t_first is None:
            t_first = time.perf_counter()
    return {"tps": (count - 1) / (time.perf_counter() - t_first), "tokens": count}


def run_mlxmtp(model, tok, prompt, n, temp, seed, enable_mtp, k):
    count, t_first, ev = 0, None, None
    for ev in stream_generate(model, tok, prompt, max_tokens=n, enable_mtp=enable_mtp, num_draft=k,
                              params=SamplingParams(temperature=temp, seed=seed)):
        count += len(ev.token_ids)
        if t_first is None:
            t_first = time.perf_counter()
    s = ev.stats.as_dict()
    return {"tps": (count - 1) / (time.perf_counter() - t_first), "tokens": count, "stats": s}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the packaged demo model")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--depths", default="1,2,3,4")
    args = ap.parse_args()

    path = args.model or str(demo_model_path())
    model, tok = load(path)
    ref, _ = mlx_lm.load(path)
    prompt = tok.encode(PROMPT)
    depths = [int(d) for d in args.depths.split(",")]
    settings = [("mlx-lm generate", None), ("mlxmtp MTP off", 0)] + [(f"mlxmtp k={k}", k) for k in depths] + [
        ("mlxmtp adaptive", "adaptive")]
    results = {name: [] for name, _ in settings}
    # warm-up
    run_mlx_lm(ref, tok, prompt, 20, args.temp, 0)
    run_mlxmtp(model, tok, prompt, 20, args.temp, 0, True, 1)
    for r in range(args.rounds):
        for name, k in settings:
            if k is None:
                results[name].append(run_mlx_lm(ref, tok, prompt, args.max_tokens, args.temp, r))
            elif k == 0:
                results[name].append(run_mlxmtp(model, tok, prompt, args.max_tokens, args.temp, r, False, None))
            else:
                results[name].append(run_mlxmtp(model, tok, prompt, args.max_tokens, args.temp, r, True,
                                                None if k == "adaptive" else k))
    c1 = forward_cost(model, 1)
    cost = {k: forward_cost(model, k + 1) / c1 for k in range(1, 5)}  # adaptive may use any depth
    base = statistics.median(x["tps"] for x in results["mlx-lm generate"])
    print(f"model: {args.model or 'demo'}   temp={args.temp}   max_tokens={args.max_tokens}   rounds={args.rounds}")
    print("forward cost relative to 1 token: " + ", ".join(f"T={k + 1}: {v:.2f}x" for k, v in cost.items()))
    print(f"{'setting':18} {'tok/s':>8} {'vs mlx-lm':>9} {'accept':>7} {'by position':>24} {'tok/fwd':>7} {'ideal':>6} {'meas/ideal':>10}")
    for name, k in settings:
        tps = statistics.median(x["tps"] for x in results[name])
        row = f"{name:18} {tps:8.1f} {tps / base:8.2f}x"
        if isinstance(k, int) and k > 0 or k == "adaptive":
            s = results[name][-1]["stats"]
            by = " ".join(f"{a:.2f}" for a in s["acceptance_by_position"])
            tpf = s["tokens_per_forward"]
            depth = k if isinstance(k, int) else max(s["depths"], key=s["depths"].get)
            ideal = tpf / cost[depth] if depth in cost else tpf
            mtp_off = statistics.median(x["tps"] for x in results["mlxmtp MTP off"])
            row += f" {s['acceptance']:7.2f} {by:>24} {tpf:7.2f} {ideal:6.2f} {tps / mtp_off / ideal:10.2f}"
            if k == "adaptive":
                row += f"   depths used: {s['depths']}"
        print(row)
    print(f"peak memory: {mx.get_peak_memory() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
