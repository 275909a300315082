"""Does the engine's verify forward cost what mlx-lm's own T-token forward costs?

The verify runs the backbone through `mlxlm.adapter.forward` on the engine's caches
(ragged attention caches; in shape-stable mode the whole buffer and an explicit mask)
while `gdn_capture` keeps what a Gated DeltaNet rollback needs. Timed against mlx-lm's
own `model(tokens, cache)` on its own caches, at the same context, T = 1..5 tokens: the
median over rounds of the ratio of the two timed back to back (order alternating), so
the machine's changes of speed cancel. After each forward the attention caches are
trimmed back; the Gated DeltaNet state just moves on (its cost does not depend on its
values).

    python bench/verify_forward.py                   # demo model
    python bench/verify_forward.py --model demo-4bit --context 1000
    python bench/verify_forward.py --model PATH
"""

from __future__ import annotations

import argparse
import tempfile
import time

import mlx.core as mx
from decode import model_path, paired_ratios
from mlx_lm.models.cache import make_prompt_cache

from mlxmtp.mlxlm import adapter, gdn_capture
from mlxmtp.models.load import load


def mlx_lm_forward(model, context):
    """A timed T-token forward of mlx-lm's own model on its own cache."""
    cache = make_prompt_cache(model.base)
    mx.eval(model.base(mx.zeros((1, context), mx.int32), cache=cache))

    def run(T):
        t0 = time.perf_counter()
        mx.eval(model.base(mx.zeros((1, T), mx.int32), cache=cache), [c.state for c in cache])
        dt = time.perf_counter() - t0
        for c in cache:
            if c.is_trimmable():
                c.trim(T)
        return dt

    return run


def verify_forward(model, context, shape_stable):
    """A timed T-token verify forward of the engine (recording for rollback when T > 1)."""
    parts = model.parts
    cache = adapter.make_cache(parts, 1)
    mx.eval(adapter.forward(parts, mx.zeros((1, context), mx.int32), cache)[0])
    if shape_stable:
        cache.fix_shapes(2)

    def run(T):
        t0 = time.perf_counter()
        tokens = mx.zeros((1, T), mx.int32)
        if T > 1:
            with gdn_capture.record():
                logits, hidden = adapter.forward(parts, tokens, cache)
        else:
            logits, hidden = adapter.forward(parts, tokens, cache)
        mx.eval(logits, hidden, *cache.arrays())
        dt = time.perf_counter() - t0
        cache.trim_rows([T])
        return dt

    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo", help='"demo", "demo-4bit", or a path or Hub id')
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = load(model_path(args.model, tmp)[0])
        report(model, args.context, args.reps)


def report(model, context, reps):
    sizes = range(1, 6)
    print(f"device: {mx.default_device()}   context: {context}   reps: {reps}")
    print("| caches | " + " | ".join(f"T={T}" for T in sizes) + " |")
    print("|---" * (len(sizes) + 1) + "|")
    theirs = mlx_lm_forward(model, context)
    for shape_stable in (False, True):
        got = paired_ratios(verify_forward(model, context, shape_stable), theirs, sizes, reps)
        label = "shape-stable" if shape_stable else "sliced"
        print(f"| {label} | " + " | ".join(f"{got[T]:.3f}x" for T in sizes) + " |")


if __name__ == "__main__":
    main()
