"""Single-request decode benchmark: mlx-lm vs mlxmtp (MTP off, k = 1..4, adaptive).

For each model and temperature, all settings run in ONE process, interleaved round by
round, and every mlxmtp run is compared with the mean of the two mlx-lm runs just before
and after it (this shared machine's speed drifts within seconds); only ratios are
meaningful, and the table gives their median and range over the rounds. Also measures the
cost of a (k+1)-token forward relative to a 1-token forward, from which the ideal speedup
of depth k over plain decoding is
    ideal(k) = tokens_per_forward(k) / (cost(k+1 tokens) / cost(1 token))
and measured/ideal is the engine's efficiency (draft cost and overhead included).

    python bench/decode.py                      # demo model and its 4-bit twin, greedy and temp 0.6
    python bench/decode.py --models demo --temps 0 --rounds 5 --markdown
    python bench/decode.py --models /path/to/mlx-model --max-tokens 200

Prompts: code, a different one each round (the demo model's held-out prompts).
Models: `demo` (the packaged demo model), `demo-4bit` (built by bench/quantized_demo.py
into a temporary folder), or a path / HF id.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_sampler

from mlxmtp.engine import mlx_lm_adapter as adapter
from mlxmtp.engine.generate import stream_generate
from mlxmtp.engine.sampling import SamplingParams
from mlxmtp.models.demo import demo_model_path
from mlxmtp.models.load import load
from mlxmtp.testing.demo_prompts import HELD_OUT_PROMPTS

PROMPT = '''def _parse_args(argv):
    """Parse command line arguments for the tool."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", help="input file")
'''
# Round r uses PROMPTS[r % len(PROMPTS)] (the mlx-lm runs beside each mlxmtp run use the
# same one): greedy decoding of one prompt is one deterministic text, on which which depth
# wins is partly the luck of where its cycles happen to start (demo, 150 tokens of the
# first prompt: fixed k = 2 kept 2.61 tokens per cycle, k = 3 2.92; 200 tokens of each of
# these six: 2.55 and 3.11).
PROMPTS = [PROMPT, *HELD_OUT_PROMPTS.values()]


def forward_cost(model, T, context=128, reps=20):
    """Seconds for one T-token forward at `context` tokens of cache (median). The cache is
    filled once; after each timed forward the attention caches are trimmed back (the Gated
    DeltaNet state just moves on: its cost does not depend on its values)."""
    parts = model.mtp.parts
    cache = adapter.make_cache(parts, 1)
    logits, _ = adapter.forward(parts, mx.zeros((1, context), mx.int32), cache)
    mx.eval(logits)
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        logits, _ = adapter.forward(parts, mx.zeros((1, T), mx.int32), cache)
        mx.eval(logits, *adapter.cache_arrays(cache))
        times.append(time.perf_counter() - t0)
        for c in adapter.attention_caches(cache):
            c.trim_rows([T])
    return statistics.median(times[2:])


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
    return {"tps": (count - 1) / (time.perf_counter() - t_first), "tokens": count, "stats": ev.stats.as_dict()}


def bench_model(name, path, temps, depths, rounds, max_tokens, markdown, quantized=False):
    model, tok = load(path)
    ref, _ = mlx_lm.load(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    settings = [("mlx-lm generate", None), ("mlxmtp MTP off", 0)] + [(f"mlxmtp k={k}", k) for k in depths] + [
        ("mlxmtp adaptive", "adaptive")]
    reps = 5 if quantized else 20
    c1 = forward_cost(model, 1, reps=reps)
    cost = {k: forward_cost(model, k + 1, reps=reps) / c1 for k in range(1, 5)}  # adaptive may use any depth
    for temp in temps:
        mx.reset_peak_memory()
        results = {name: [] for name, _ in settings}
        peak = {}
        # Warm-up. The adaptive policy's cost calibration belongs to the model (once per
        # server lifetime, shared by all requests), so it is warmed up like the rest.
        run_mlx_lm(ref, tok, prompts[0], 16, temp, 0)
        run_mlxmtp(model, tok, prompts[0], 16, temp, 0, True, 1)
        run_mlxmtp(model, tok, prompts[0], max_tokens, temp, 0, True, None)
        ours = [(label, k) for label, k in settings if k is not None]
        ref_label = settings[0][0]
        paired = {label: [] for label, _ in ours}  # per round: tok/s / mean of the mlx-lm runs beside it
        for r in range(rounds):
            prompt = prompts[r % len(prompts)]
            # Every mlxmtp run sits between two mlx-lm runs and is compared with their mean:
            # this machine's speed drifts by tens of percent within seconds, so a baseline
            # measured a whole round away would mostly measure the drift. Odd rounds run the
            # settings in reverse order, so a drift during a round favours none of them.
            before = _run(ref, model, tok, prompt, max_tokens, temp, r, None)
            results[ref_label].append(before)
            for label, k in (ours if r % 2 == 0 else ours[::-1]):
                mx.reset_peak_memory()
                res = _run(ref, model, tok, prompt, max_tokens, temp, r, k)
                peak[label] = max(peak.get(label, 0), mx.get_peak_memory())
                mx.reset_peak_memory()
                after = _run(ref, model, tok, prompt, max_tokens, temp, r, None)
                peak[ref_label] = max(peak.get(ref_label, 0), mx.get_peak_memory())
                results[label].append(res)
                results[ref_label].append(after)
                paired[label].append(res["tps"] / ((before["tps"] + after["tps"]) / 2))
                before = after
        print(f"\nmodel: {name}   temp={temp}   max_tokens={max_tokens}   rounds={rounds} "
              "(medians; speedups: of each run against the mean of the two mlx-lm runs beside it)")
        print("forward cost relative to 1 token: " + ", ".join(f"T={k + 1}: {v:.2f}x" for k, v in cost.items()))
        cols = ["setting", "tok/s", "vs mlx-lm", "range", "acceptance by position", "tok/fwd", "ideal", "meas/ideal",
                "peak MiB"]
        rows = []
        for label, k in settings:
            tps = statistics.median(x["tps"] for x in results[label])
            ratios = paired.get(label, [1.0])
            vs_ref = statistics.median(ratios)
            vs_off = statistics.median(x["tps"] / y["tps"] for x, y in zip(results[label], results["mlxmtp MTP off"]))
            row = [label, f"{tps:.1f}", f"{vs_ref:.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}" if label in paired else "",
                   "", "1.00" if k in (None, 0) else "", "", "", f"{peak[label] / 2**20:.0f}"]
            if k not in (None, 0):
                st = [x["stats"] for x in results[label]]
                by = _pooled_by_position(st)
                tpf = statistics.median(s["tokens_per_forward"] for s in st)
                row[4] = " ".join(f"{a:.2f}" for a in by)
                row[5] = f"{tpf:.2f}"
                if k != "adaptive":
                    ideal = tpf / cost[k]
                    row[6], row[7] = f"{ideal:.2f}", f"{vs_off / ideal:.2f}"
                else:
                    depths_used = {}
                    for s in st:
                        for d, n in s["depths"].items():
                            depths_used[int(d)] = depths_used.get(int(d), 0) + n
                    row[0] += " (depths used: " + ", ".join(f"{d}:{n}" for d, n in sorted(depths_used.items())) + ")"
            rows.append(row)
        _print_table(cols, rows, markdown)


def _run(ref, model, tok, prompt, max_tokens, temp, seed, k):
    """One request: mlx-lm (k None), mlxmtp MTP off (0), a pinned depth, or "adaptive"."""
    if k is None:
        return run_mlx_lm(ref, tok, prompt, max_tokens, temp, seed)
    if k == 0:
        return run_mlxmtp(model, tok, prompt, max_tokens, temp, seed, False, None)
    return run_mlxmtp(model, tok, prompt, max_tokens, temp, seed, True, None if k == "adaptive" else k)


def _pooled_by_position(stats):
    """Acceptance by position, the mean over rounds of each round's rate."""
    out = []
    for i in range(max(len(s["acceptance_by_position"]) for s in stats)):
        vals = [s["acceptance_by_position"][i] for s in stats if len(s["acceptance_by_position"]) > i]
        out.append(statistics.mean(vals))
    return out


def _print_table(cols, rows, markdown):
    if markdown:
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="demo,demo-4bit")
    ap.add_argument("--temps", default="0,0.6")
    ap.add_argument("--max-tokens", type=int, default=150)
    ap.add_argument("--max-tokens-quantized", type=int, default=80,
                    help="for quantized models (MLX's CPU quantized kernels are ~10x slower)")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--rounds-quantized", type=int, default=3)
    ap.add_argument("--depths", default="1,2,3,4")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    temps = [float(t) for t in args.temps.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "demo":
                path, quantized = str(demo_model_path()), False
            elif name == "demo-4bit":
                from quantized_demo import quantized_demo

                path, quantized = str(quantized_demo(f"{tmp}/demo-4bit", bits=4)), True
            else:
                from mlxmtp.models.load import inspect_model

                path, quantized = name, bool(inspect_model(name).get("quantization"))
            n = args.max_tokens_quantized if quantized else args.max_tokens
            rounds = args.rounds_quantized if quantized else args.rounds
            bench_model(name, path, temps, depths, rounds, n, args.markdown, quantized)


if __name__ == "__main__":
    main()
