"""Shared helpers for the engine tests: mlx-lm references and forced-draft hooks."""

from __future__ import annotations

import random
from functools import lru_cache

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step

from mlxmtp.models.load import load


@lru_cache(maxsize=None)
def loaded(path: str):
    """(mlxmtp model with head, tokenizer, stock mlx-lm model) for a fixture folder."""
    model, tok = load(path)
    ref, _ = mlx_lm.load(path)
    return model, tok, ref


def reference_greedy(ref_model, prompt, n):
    """mlx-lm's own greedy decoding: the ground truth every MTP setting must match."""
    out = []
    for tok, _ in generate_step(mx.array(prompt), ref_model, max_tokens=n):
        out.append(int(tok))
        if len(out) == n:
            break
    return out


def prompt_of(length: int, seed: int = 0, vocab: int = 290):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def oracle_hook(expected: dict, p_correct: float = 0.7, seed: int = 0):
    """Replace drafts by the known continuation, each corrupted with prob 1 - p_correct,
    so every acceptance length 0..k occurs. expected: request id -> full greedy output."""
    rng = random.Random(seed)

    def hook(rows, drafts):
        k = drafts.shape[1]
        out = []
        for b, row in enumerate(rows):
            if row.req.id not in expected:  # e.g. sampled rows keep their own drafts
                out.append(drafts[b].tolist())
                continue
            ref = expected[row.req.id]
            g = row.generated  # tokens emitted so far; the next one is ref[g]
            d = []
            for i in range(k):
                t = ref[g + i] if g + i < len(ref) else 0
                if rng.random() > p_correct:
                    t = (t + 1 + rng.randrange(50)) % 290
                d.append(t)
            out.append(d)
        return mx.array(out, dtype=mx.int32)

    return hook
