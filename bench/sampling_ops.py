"""What the sampled rows of a batch add to a decode cycle: graph nodes and device time of one
draft step and one accept step (depth 3, with each draft's keep chance, as the engine
evaluates it), for batches of 1 and 8 rows, greedy, at temperature 0.6 and at 0.6 seeded
(reproducible rows: argmax agreement under shared noise), on a vocabulary of `--vocab`
tokens (random logits: neither step's cost depends on the values).

A small model's cycle on a GPU is bound by kernel launches, so the number of operations a
step builds is its cost there, whatever the arithmetic: the engine's sampled steps are
vectorised over the rows for that (sampling/batch.py: BatchSampling).

    python bench/sampling_ops.py [--vocab 151936] [--reps 50]
"""

from __future__ import annotations

import argparse
import io
import re
import statistics
import time

import mlx.core as mx

from mlxmtp.engine.sampling.accept import VerifyMetadata, accept, picker
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.engine.sampling.row import RowSampler

DEPTH = 3


def graph_nodes(*arrays) -> int:
    out = io.StringIO()
    mx.export_to_dot(out, *arrays)
    return len(re.findall(r'label\s*=\s*"[A-Za-z]', out.getvalue()))


def steps(batch: int, temp: float, seeded: bool, vocab: int):
    """(draft step, accept step): functions building one step's graph -> its output arrays."""
    samplers = [RowSampler(SamplingParams(temperature=temp, seed=b, reproducible=seeded)) for b in range(batch)]
    logits = mx.random.normal((batch, DEPTH + 1, vocab), key=mx.random.key(0)).astype(mx.bfloat16)
    drafts = mx.zeros((batch, DEPTH), mx.int32)
    lg = logits[:, :DEPTH].astype(mx.float32)
    q = lg - mx.logsumexp(lg, axis=-1, keepdims=True) if temp else None
    mx.eval(logits, drafts, *([q] if q is not None else []))
    pick = picker(samplers, [[0]] * batch, [0] * batch)

    def draft_step():
        tok, lp = pick(0, logits[:, 0], mx.zeros((batch, 0), mx.int32))
        return [tok, *([lp] if lp is not None else [])]

    def accept_step():
        kept, tokens, _, chances = accept(VerifyMetadata(drafts, q, samplers, [[0]] * batch, [0] * batch, None), logits)
        return [kept, tokens, *([chances] if chances is not None else [])]

    return draft_step, accept_step


def measure(step, reps: int):
    """(graph nodes, median ms to build and evaluate it)."""
    nodes = graph_nodes(*step())
    for _ in range(3):
        mx.eval(step())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(step())
        times.append(time.perf_counter() - t)
    return nodes, 1e3 * statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    print(f"device: {mx.default_device()}   vocabulary {args.vocab}   accept step at depth {DEPTH}")
    print("| rows | temperature | draft step: nodes | ms | accept step: nodes | ms |")
    print("|---|---|---|---|---|---|")
    for batch in (1, 8):
        for temp, seeded in ((0.0, False), (0.6, False), (0.6, True)):
            draft_step, accept_step = steps(batch, temp, seeded, args.vocab)
            (dn, dms), (an, ams) = measure(draft_step, args.reps), measure(accept_step, args.reps)
            print(f"| {batch} | {temp}{', seeded' if seeded else ''} | {dn} | {dms:.2f} | {an} | {ams:.2f} |")


if __name__ == "__main__":
    main()
