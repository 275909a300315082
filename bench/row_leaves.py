"""A short conversation's decode speed after a long one in its batch has finished.

A batch's attention buffers hold every row at the capacity of its longest row. When that
row leaves, the rows left behind get buffers cut to what they need (RaggedKVCache.filter);
otherwise they would go on holding the long row's capacity, and attending over it in
every shape-stable verify (the GPU default), for as long as the batch runs. Measured
side by side in one run, for drafting cycles at depth k: a short request decoding alone,
and the same request once a long one that ran beside it has left. The two should match.

    python bench/row_leaves.py                       # demo model, a 4000-token long prompt
    python bench/row_leaves.py --long 8000 --model PATH
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
from mlxmtp.models.load import load


def short_row_speed(model, tok, short, long, k, tokens):
    """(tok/s of `short` once `long` (None: alone) has left the batch, the attention buffers'
    capacity then)."""
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=k, shape_stable=True))
    if long is not None:
        eng.submit(Request(prompt=long, max_tokens=2))
    req = Request(prompt=short, max_tokens=tokens)
    eng.submit(req)
    got, t0, cap = 0, None, 0
    while eng.has_work:
        events = eng.step()
        if t0 is None and eng.rows and len(eng.rows) == 1 and eng.rows[0].req.id == req.id and not eng.waiting:
            mx.synchronize()
            t0 = time.perf_counter()
            cap = eng.batch.cache.attention()[0].keys.shape[2]
            continue
        if t0 is not None:
            got += sum(len(e.token_ids) for e in events if e.request_id == req.id)
    return got / (time.perf_counter() - t0), cap


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo", help='"demo", "demo-4bit", or a path or Hub id')
    ap.add_argument("--long", type=int, default=4000, help="tokens of the long prompt")
    ap.add_argument("--tokens", type=int, default=200, help="tokens the short request decodes")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = load(model_path(args.model, tmp)[0])
    short = tok.encode(PROMPT)
    long = (tok.encode(PROMPT) * (args.long // len(short) + 1))[: args.long]
    print(f"device: {mx.default_device()}   long prompt: {args.long} tokens   depth: {args.depth}")
    print("| round | alone tok/s | after the long row left tok/s | ratio | capacity alone / after |")
    print("|---|---|---|---|---|")
    ratios = []
    for r in range(args.rounds):
        alone, cap_alone = short_row_speed(model, tok, short, None, args.depth, args.tokens)
        after, cap_after = short_row_speed(model, tok, short, long, args.depth, args.tokens)
        ratios.append(after / alone)
        print(f"| {r + 1} | {alone:.1f} | {after:.1f} | {after / alone:.2f}x | {cap_alone} / {cap_after} |")
    print(f"median ratio: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
