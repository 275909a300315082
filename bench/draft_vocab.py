"""Draft step cost with the full vs a trimmed (FastMTP) draft vocabulary, Qwen3.5-4B-shaped.

One MTP draft step as the engine runs it (engine/proposers/mtp_head.draft): embed the previous
draft, the head (fc, one full-attention decoder layer with a KV cache of `--context`
rows, norm), the drafter's lm_head (models.draft_vocab.DraftVocab: the whole table, or
the listed rows scattered back to full width with -inf), argmax. lm_head alone is timed
too. Random weights, shaped like Qwen3.5-4B: hidden 2560, 16 query / 4 KV heads of 256,
intermediate 9216 (assumed, not checked against the config), vocabulary 248320, tied
embeddings. bf16, and 4-bit (mlx.nn.quantize, group 64, as mlx-lm quantizes the model and
add-mtp-weights the head).

Device-neutral: runs on MLX's default device. Unquantized heads compute in float32 on
the CPU, as models.head_build.build_head makes them there. All settings live in one process
and every round times each of them in turn (this shared machine's speed drifts); the
table gives medians over rounds.

    python bench/draft_vocab.py                  # 3-4 minutes on a busy 2-core CPU
    python bench/draft_vocab.py --rounds 9 --trim 32768 --context 512
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_5 import TextModelArgs

from mlxmtp.mlxlm.family import TextParts
from mlxmtp.models.draft_vocab import DraftVocab
from mlxmtp.models.mtp_head import MTPHead

QWEN35_4B = dict(model_type="qwen3_5_text", hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=256, vocab_size=248320,
                 tie_word_embeddings=True, full_attention_interval=4)


def random_table(rows: int, cols: int) -> mx.array:
    """A bf16 [rows, cols] table: one random block tiled (the values do not change the cost;
    drawing 635M normals would take longer than the whole measurement)."""
    block = (mx.random.normal((4096, cols), key=mx.random.key(1)) * 0.02).astype(mx.bfloat16)
    return mx.tile(block, (rows // 4096 + 1, 1))[:rows]


def quantized_embedding(table: mx.array, bits: int) -> nn.QuantizedEmbedding:
    """What mlx-lm's quantization makes of the embedding, without QuantizedEmbedding's own
    random initialisation of a full-size table (a small one is built, then given ours)."""
    q = nn.QuantizedEmbedding(64, table.shape[1], group_size=64, bits=bits)
    q.weight, q.scales, q.biases = mx.quantize(table, 64, bits)
    q.num_embeddings = table.shape[0]
    return q


def build(table: mx.array, bits: int, context: int, trim: int):
    """(head, {"full": DraftVocab, "trimmed": DraftVocab}, head cache) for one precision."""
    args = TextModelArgs(**QWEN35_4B)
    embed = nn.Embedding(64, args.hidden_size)
    embed.weight = table
    if bits:
        embed = quantized_embedding(table, bits)
    parts = TextParts(family="qwen3_5", args=args,
                      text_model=SimpleNamespace(args=args, model=SimpleNamespace(embed_tokens=embed)))
    head = MTPHead(parts)
    head.set_dtype(mx.bfloat16)
    compute = mx.bfloat16
    if bits:  # the head quantized as add-mtp-weights does (every Linear, group 64)
        nn.quantize(head, group_size=64, bits=bits)
    elif mx.default_device() == mx.cpu:  # what head_build.build_head does on the CPU
        head.update(tree_map(lambda a: a.astype(mx.float32), head.parameters()))
        compute = mx.float32
    mx.eval(embed.parameters(), head.parameters())
    # A corpus list would favour frequent (often low) ids; random rows cost the same.
    ids = mx.random.permutation(args.vocab_size, key=mx.random.key(0))[:trim].tolist()
    vocabs = {"full": DraftVocab(parts, compute_dtype=compute),
              "trimmed": DraftVocab(parts, compute_dtype=compute, token_ids=ids)}
    # `context` rows of random keys and values (running the head over them would cost a minute
    # with the CPU's quantized kernels; the step's cost does not depend on their values).
    cache = [KVCache()]
    kv = mx.random.normal((1, args.num_key_value_heads, context, args.head_dim)).astype(compute)
    cache[0].update_and_fetch(kv, kv)
    mx.eval(cache[0].state)
    return head, vocabs, cache


def draft_step(head, vocab, cache, tok, g):
    """One chained draft, as proposers/mtp_head.draft runs step > 0; the cache row is dropped after."""
    g = head(vocab.embed_tokens(tok[:, None]), g, cache)
    tok = mx.argmax(vocab.lm_head(g)[:, 0, :], axis=-1)
    mx.eval(tok, g)
    cache[0].trim(1)
    return tok, g


def project(vocab, g):
    mx.eval(vocab.lm_head(g))


def timed(fn, reps: int) -> float:
    """Median seconds of `reps` calls after an untimed one: on the CPU a first call after the
    other settings ran pays for fresh buffers (the bf16 table's float32 cast, 2.5 GB) that
    the engine's steady drafting reuses; timed cold, lm_head alone measured 2x the step."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def one_round(setups: dict, reps: int) -> dict:
    """{(bits, vocabulary, "lm_head" | "step"): seconds}, every setting timed in turn."""
    out = {}
    for b, (head, vocabs, cache) in setups.items():
        g = mx.random.normal((1, 1, head.fc.weight.shape[0])).astype(head.norm.weight.dtype)
        tok = mx.array([17], mx.int32)
        for kind, vocab in vocabs.items():
            out[(b, kind, "lm_head")] = timed(partial(project, vocab, g), reps)
            out[(b, kind, "step")] = timed(partial(draft_step, head, vocab, cache, tok, g), reps)
    return out


def run(rounds: int, reps: int, context: int, trim: int, bits_list) -> dict:
    """Milliseconds: median over `rounds` rounds of medians of `reps` calls."""
    weights = random_table(QWEN35_4B["vocab_size"], QWEN35_4B["hidden_size"])
    setups = {b: build(weights, b, context, trim) for b in bits_list}
    res = [one_round(setups, reps) for _ in range(rounds)]
    return {k: statistics.median(r[k] for r in res) * 1e3 for k in res[0]}


def table(res, bits_list, trim, vocab_size) -> str:
    lines = ["| weights | draft vocabulary | lm_head ms | speedup | draft step ms | speedup |",
             "|---|---|---|---|---|---|"]
    for b in bits_list:
        name = f"{b}-bit" if b else "bf16"
        for kind, rows in (("full", vocab_size), ("trimmed", trim)):
            lm, step = res[(b, kind, "lm_head")], res[(b, kind, "step")]
            lines.append(f"| {name} | {kind} ({rows}) | {lm:.1f} | {res[(b, 'full', 'lm_head')] / lm:.2f}x | "
                         f"{step:.1f} | {res[(b, 'full', 'step')] / step:.2f}x |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=1, help="timed calls per setting per round")
    ap.add_argument("--context", type=int, default=256, help="rows in the head's KV cache")
    ap.add_argument("--trim", type=int, default=32768)
    ap.add_argument("--bits", type=int, nargs="*", default=[0, 4], help="0 = bf16")
    a = ap.parse_args()
    t0 = time.perf_counter()
    res = run(a.rounds, a.reps, a.context, a.trim, a.bits)
    print(f"device: {mx.default_device()}, context {a.context}, medians of {a.rounds} rounds x {a.reps} calls "
          f"({time.perf_counter() - t0:.0f} s)\n")
    print(table(res, a.bits, a.trim, QWEN35_4B["vocab_size"]))


if __name__ == "__main__":
    main()
