"""Short conversations decoding beside a long one: attention per group of rows against one
padded call over the whole batch.

One batch: a long prompt and a few short ones, all decoding. With one attention call every
row reads the KV of the longest row's length; grouped (mlxlm/row_attention.py) each group of
rows reads its own. Both run in the same engine on the same rows, alternating every few
steps (the call cost switched between its default and "never split"), so the contexts are
the same on both sides; the batch's tokens per second is what is compared.

    python bench/ragged_rows.py                      # demo model, 8000-token long prompt
    python bench/ragged_rows.py --long 16000 --n-short 3 --depths 0,2 --shape-stable --model PATH
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import mlx.core as mx
from decode import PROMPT, model_path

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.request import Request
from mlxmtp.mlxlm import row_attention
from mlxmtp.models.load import load

NEVER_SPLIT = 1 << 60


def prompts(tok, long: int, short: int, n_short: int):
    base = tok.encode(PROMPT)
    return [(base * (n // len(base) + 1))[:n] for n in [long] + [short] * n_short]


def decoding_batch(model, tok, prompts_, depth: int, tokens: int, shape_stable=None):
    """An engine whose rows have all been prefilled and are decoding."""
    eng = BatchGenerator(model, tok, EngineConfig(enable_mtp=depth > 0, num_draft=depth or None, prefill_step=2048,
                                                  shape_stable=shape_stable))
    for p in prompts_:
        eng.submit(Request(prompt=p, max_tokens=tokens))
    while eng.waiting or len(eng.rows) < len(prompts_):
        eng.step()
    return eng


def window(eng, steps: int, call_cost: int) -> float:
    """Tokens per second of the whole batch over `steps` engine steps at `call_cost`."""
    row_attention.CALL_COST_POSITIONS = call_cost
    eng.step()  # the first step at this setting builds nothing the window should count
    mx.synchronize()
    got, t0 = 0, time.perf_counter()
    for _ in range(steps):
        got += sum(len(e.token_ids) for e in eng.step())
    mx.synchronize()
    return got / (time.perf_counter() - t0)


def measure(eng, windows: int, steps: int):
    """(grouped tok/s per window, padded tok/s per window), interleaved."""
    grouped, padded = [], []
    default = row_attention.CALL_COST_POSITIONS
    try:
        for _ in range(windows):
            grouped.append(window(eng, steps, default))
            padded.append(window(eng, steps, NEVER_SPLIT))
    finally:
        row_attention.CALL_COST_POSITIONS = default
    return grouped, padded


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo", help='"demo", "demo-4bit", or a path or Hub id')
    ap.add_argument("--long", type=int, default=8000, help="tokens of the long prompt")
    ap.add_argument("--short", type=int, default=200, help="tokens of each short prompt")
    ap.add_argument("--n-short", type=int, default=3, help="how many short prompts")
    ap.add_argument("--depths", default="0,2", help="draft depths (0: MTP off)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="engine steps per window")
    ap.add_argument("--shape-stable", action="store_true", help="shape-stable caches (the GPU default)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = load(model_path(args.model, tmp)[0])
    rows = prompts(tok, args.long, args.short, args.n_short)
    print(f"device: {mx.default_device()}   rows: 1 x {args.long} + {args.n_short} x {args.short} tokens")
    print("| setting | grouped tok/s | padded tok/s | grouped / padded | range | attention calls |")
    print("|---|---|---|---|---|---|")
    for depth in (int(d) for d in args.depths.split(",")):
        tokens = 4 * args.windows * (args.steps + 1) * (depth + 1) + 256
        eng = decoding_batch(model, tok, rows, depth, tokens, args.shape_stable or None)
        grouped, padded = measure(eng, args.windows, args.steps)
        ratios = [g / p for g, p in zip(grouped, padded)]
        groups = eng.batch.cache.attention()[0]._plan_groups(1) if eng.batch.cache else None
        name = "MTP off" if depth == 0 else f"k={depth}"
        print(f"| {name} | {statistics.median(grouped):.1f} | {statistics.median(padded):.1f} | "
              f"{statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f} | "
              f"{1 if groups is None else len(groups)} |")


if __name__ == "__main__":
    main()
