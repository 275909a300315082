"""A batch whose rows draft different lengths: one padded verify, or one per length?

In a hybrid cycle (engine/proposers/hybrid_plan.py) the rows copying text verify a long suffix
draft (8-32 tokens) and the rows beside them a few of the head's drafts, and the verify is one
forward of the batch at the longest row's length: the short rows are padded to it. Where a
forward's cost grows with its tokens (compute-bound: a CPU, or a GPU once the batch's tokens
outgrow what its memory bandwidth hides) the padding costs as much as real tokens; where it is
bound by reading the weights, one forward of all the rows costs about what one row's does, and
two forwards cost two weight reads. This times both on the engine's verify forward (its
caches, recording for the Gated DeltaNet rollback) at the same context:

- padded: one forward of every row at the long length;
- split: one forward of the long rows at their length, one of the short rows at theirs, on
  caches of their own (what a split verify would run);

and prints the median over rounds of split / padded, the two timed back to back (order
alternating), beside the share of the padded forward's tokens that are real (what split /
padded comes to where a forward costs its tokens alone).

    python bench/split_verify.py                        # demo model, 4 rows, 2 of them long
    python bench/split_verify.py --rows 8 --long-rows 2 --context 2000
    python bench/split_verify.py --model PATH
"""

from __future__ import annotations

import argparse
import tempfile
import time

import mlx.core as mx
from decode import model_path, paired_ratios

from mlxmtp.mlxlm import adapter, gdn_capture
from mlxmtp.models.load import load


def verifier(parts, rows: int, context: int):
    """The verify of `rows` rows at `context` tokens of cache, as (launch(T): the arrays of a
    T-token forward of every row, to evaluate; settle(T): the caches back to `context`)."""
    cache = adapter.make_cache(parts, rows)
    mx.eval(adapter.forward(parts, mx.zeros((rows, context), mx.int32), cache)[0])

    def launch(T):
        with gdn_capture.record():
            logits, hidden = adapter.forward(parts, mx.zeros((rows, T), mx.int32), cache)
        return [logits, hidden, *cache.arrays()]

    def settle(T):
        cache.trim_rows([T] * rows)  # back to `context` (the Gated DeltaNet state just moves on)

    return launch, settle


def timed(*sides):
    """run(T) -> seconds of the forwards of `sides` ((launch, settle, tokens(T)) each), evaluated together."""

    def run(T):
        t0 = time.perf_counter()
        mx.eval([a for launch, _, tokens in sides for a in launch(tokens(T))])
        dt = time.perf_counter() - t0
        for _, settle, tokens in sides:
            settle(tokens(T))
        return dt

    return run


def report(model, rows: int, long_rows: int, short: int, sizes, context: int, reps: int):
    parts = model.parts
    padded = timed((*verifier(parts, rows, context), lambda T: T))
    split = timed((*verifier(parts, long_rows, context), lambda T: T),
                  (*verifier(parts, rows - long_rows, context), lambda T: short))
    got = paired_ratios(split, padded, sizes, reps)
    print(f"device: {mx.default_device()}   context: {context}   reps: {reps}   "
          f"{rows} rows, {long_rows} verifying T tokens, the rest {short}")
    print("| long rows' T | " + " | ".join(f"{T}" for T in sizes) + " |")
    print("|---" * (len(sizes) + 1) + "|")
    print("| split / padded | " + " | ".join(f"{got[T]:.3f}x" for T in sizes) + " |")
    real = {T: (long_rows * T + (rows - long_rows) * short) / (rows * T) for T in sizes}
    print("| real tokens / padded tokens | " + " | ".join(f"{real[T]:.3f}" for T in sizes) + " |")
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo", help='"demo", "demo-4bit", or a path or Hub id')
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--long-rows", type=int, default=2, help="rows verifying a long (suffix) draft")
    ap.add_argument("--short", type=int, default=4, help="tokens the other rows verify (the head's k = 3)")
    ap.add_argument("--sizes", default="9,17,33", help="tokens the long rows verify (suffix drafts of 8, 16, 32)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    if not 0 < args.long_rows < args.rows:
        ap.error("--long-rows must be between 1 and --rows - 1")
    sizes = [int(s) for s in args.sizes.split(",")]
    if min(sizes) <= args.short:
        ap.error("every size must be longer than --short (the long rows set the padded length)")
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = load(model_path(args.model, tmp)[0])
        report(model, args.rows, args.long_rows, args.short, sizes, args.context, args.reps)


if __name__ == "__main__":
    main()
