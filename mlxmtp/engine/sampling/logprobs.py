"""Logprob tables: what a request that asked for logprobs reads of each token it emits."""

from __future__ import annotations

import mlx.core as mx


def logprob_table(logits: mx.array, tokens: mx.array, top_n: int) -> mx.array:
    """logits [..., V], chosen tokens [...] -> [..., 1 + 2 * top_n] float32: the chosen
    token's log-probability, then the ids of the top_n most likely tokens (most likely
    first; float32 holds ids below 2**24 exactly), then their log-probabilities.

    One array, so a cycle's tables are selected, evaluated and read with its tokens
    (output.logprob_entry reads one row back)."""
    lp = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(mx.float32)
    chosen = mx.take_along_axis(lp, tokens[..., None].astype(mx.int32), axis=-1)
    if not top_n:
        return chosen
    top = mx.argpartition(-lp, top_n - 1, axis=-1)[..., :top_n]
    top_lp = mx.take_along_axis(lp, top, axis=-1)
    order = mx.argsort(-top_lp, axis=-1)
    top, top_lp = mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(top_lp, order, axis=-1)
    return mx.concatenate([chosen, top.astype(mx.float32), top_lp], axis=-1)
