"""The array steps sampling is built of, shared by one row's sampler (row.py) and the
batch's (batch.py).

Temperature alone (no filter), the usual case, runs as single compiled graphs, as mlx-lm
compiles its own sampler: built from separate operations (two log-softmaxes, then the
draw) the same draw costs several more kernels per token, which shows on a small model.
The log-softmax of the log-softmax over T is the log-softmax of logits / T. Every draw is
argmax(x + Gumbel noise) from the row's own key (a sample of softmax(x); the noise does
not depend on the normalisation), so a row draws the same token alone or in a batch.
"""

from __future__ import annotations

from typing import List, Sequence

import mlx.core as mx


@mx.compile
def tempered_logprobs(logits: mx.array, inv_temps: mx.array) -> mx.array:
    # logits [..., V] -> log-softmax(logits * inv_temps) (inv_temps broadcast on logits).
    lp = logits * inv_temps
    return lp - mx.logsumexp(lp, axis=-1, keepdims=True)


@mx.compile
def tempered_draws(logits: mx.array, inv_temps: mx.array, keys: mx.array) -> mx.array:
    # Rows of temperature-only samplers at once: logits [B, V], inv_temps [B, 1] and keys
    # [B, 2] -> one draw per row [B].
    return mx.argmax(logits * inv_temps + gumbel_rows(keys, logits.shape[-1]), axis=-1)


@mx.compile
def tempered_picks(logits: mx.array, inv_temps: mx.array, keys: mx.array):
    # `tempered_draws` that also returns the log-probabilities [B, V] the draws came from
    # (a draft's q).
    lp = tempered_logprobs(logits, inv_temps)
    return mx.argmax(lp + gumbel_rows(keys, logits.shape[-1]), axis=-1), lp


split_rows = mx.compile(mx.vmap(mx.random.split))  # keys [B, 2] -> [B, 2, 2]


def gumbel_rows(keys: mx.array, vocab: int) -> mx.array:
    """keys [B, 2] -> [B, vocab] Gumbel noise, row b's from keys[b] alone (one vectorised op)."""
    return mx.vmap(lambda key: mx.random.gumbel(shape=(vocab,), key=key))(keys)


def take_rows(x: mx.array, rows: List[int]) -> mx.array:
    """x[rows] (x itself when `rows` is every row: no gather)."""
    return x if rows == list(range(x.shape[0])) else x[mx.array(rows)]


def put_rows(x: mx.array, rows: List[int], values: mx.array) -> mx.array:
    """x with x[rows] = values (all of x when `rows` is every row: no scatter)."""
    if rows == list(range(x.shape[0])):
        return values.astype(x.dtype)
    x[mx.array(rows)] = values
    return x


def inverse_temperatures(temperatures: Sequence[float]) -> mx.array:
    """[B, 1] float32: 1 / temperature per row (1 for a greedy row, whose draw is not used)."""
    return mx.array([[1.0 / t if t > 0 else 1.0] for t in temperatures], dtype=mx.float32)
