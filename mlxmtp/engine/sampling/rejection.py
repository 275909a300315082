"""Decide how many drafts a row keeps and which token follows them.

Greedy: draft j is kept iff it equals the target's argmax at its position; the
tokens emitted are then simply the target's argmaxes up to the first mismatch.

Sampling (Leviathan et al. 2023, Chen et al. 2023): keep draft x with probability
min(1, p(x) / q(x)); at the first rejection draw from normalize(max(p - q, 0)); when
every draft is kept draw the bonus from p. p and q are the target's and the draft's
distributions AFTER the request's processors, filters and temperature, which is
what makes the output distribution exactly the target's. Seeded requests are decided
by another exact rule, whose output does not depend on the depth (seeded.py).

Everything stays lazy on the device; the caller evaluates once per cycle.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional, Tuple

import mlx.core as mx


def accept_greedy(target_logits: mx.array, drafts: mx.array) -> Tuple[mx.array, mx.array]:
    """target_logits [B, k+1, V], drafts [B, k] -> (kept drafts [B], tokens [B, k+1]).

    Row b emits tokens[b, : kept[b] + 1].
    """
    target = mx.argmax(target_logits, axis=-1)
    k = drafts.shape[1]
    match = (target[:, :k] == drafts).astype(mx.int32)
    kept = mx.cumprod(match, axis=1).sum(axis=1)
    return kept, target


def accept_sampled(
    p_logprobs: mx.array,
    q_logprobs: mx.array,
    drafts: mx.array,
    key: Optional[mx.array],
    rule: str = "exact",
) -> Tuple[mx.array, mx.array]:
    """One row. p_logprobs [k+1, V], q_logprobs [k, V], drafts [k] -> (kept, tokens [k+1]).

    `rule="argmax"` is the deliberately wrong rule some engines use (keep a draft iff it
    is the target's argmax); it exists only so the tests can show they catch it.
    """
    u, g = row_noise(key, drafts.shape[0], p_logprobs.shape[-1])
    kept, tokens = accept_sampled_rows(p_logprobs[None], q_logprobs[None], drafts[None], u[None], g[None], rule)
    return kept[0], tokens[0]


def row_noise(key: Optional[mx.array], k: int, vocab: int) -> Tuple[mx.array, mx.array]:
    """One row's random numbers for `accept_sampled_rows`, from its own key: k uniforms
    (accept or reject each draft) and V Gumbels (the draw after them, argmax(log p + Gumbel
    noise), a sample of p), so a row draws the same token alone or in a batch."""
    k_accept, k_resid = mx.random.split(key) if key is not None else (None, None)
    return mx.random.uniform(shape=(k,), key=k_accept), mx.random.gumbel(shape=(vocab,), key=k_resid)


@mx.compile
def _rows_noise(keys: mx.array, k: int, vocab: int) -> Tuple[mx.array, mx.array]:
    return mx.vmap(lambda key: row_noise(key, k, vocab))(keys)


def rows_noise(keys: mx.array, k: int, vocab: int) -> Tuple[mx.array, mx.array]:
    """keys [S, 2] -> (uniforms [S, k], Gumbels [S, vocab]): each row's `row_noise` from its
    own key, all rows in one compiled graph."""
    return _rows_noise(keys, k, vocab)


def accept_sampled_rows(
    p_logprobs: mx.array,
    q_logprobs: mx.array,
    drafts: mx.array,
    uniforms: mx.array,
    gumbels: mx.array,
    rule: str = "exact",
) -> Tuple[mx.array, mx.array]:
    """S sampled rows at once. p_logprobs [S, k+1, V], q_logprobs [S, k, V], drafts [S, k],
    uniforms [S, k], gumbels [S, V] (row_noise) -> (kept [S], tokens [S, k+1])."""
    S, k = drafts.shape
    rows = mx.arange(S)[:, None]
    idx = mx.arange(k)[None, :]
    if rule == "exact":
        accept = mx.log(uniforms) < (p_logprobs[rows, idx, drafts] - q_logprobs[rows, idx, drafts])
    elif rule == "argmax":
        accept = mx.argmax(p_logprobs[:, :k], axis=-1) == drafts
    else:
        raise ValueError(rule)
    kept = mx.cumprod(accept.astype(mx.int32), axis=1).sum(axis=1)
    # The token after the kept drafts: residual distribution at a rejection, p for the bonus.
    # Only the position after the kept drafts is read: q there (0 past the last draft) is
    # gathered before any exp, so the work is one vocabulary row per row, not k.
    p_m = mx.exp(mx.take_along_axis(p_logprobs, kept[:, None, None], axis=1)[:, 0])
    q_at = mx.take_along_axis(q_logprobs, mx.minimum(kept, k - 1)[:, None, None], axis=1)[:, 0]
    q_m = mx.where((kept < k)[:, None], mx.exp(q_at), mx.zeros_like(q_at))
    resid = mx.maximum(p_m - q_m, 0.0)
    # p == q makes the residual empty; then any draw from p is exact (it cannot be reached
    # with positive probability anyway, this only guards against 0/0).
    resid = mx.where(resid.sum(axis=-1, keepdims=True) > 0, resid, p_m)
    nxt = mx.argmax(mx.log(resid) + gumbels, axis=-1)
    tokens = mx.concatenate([drafts, mx.zeros((S, 1), drafts.dtype)], axis=1)
    tokens = mx.where(mx.arange(k + 1)[None, :] == kept[:, None], nxt[:, None].astype(tokens.dtype), tokens)
    return kept, tokens


# The same rules as single compiled graphs, traced once per shape (batch, depth,
# vocabulary), as mlx-lm compiles its samplers: op by op, each is a dozen small kernels.
compiled_accept_greedy = mx.compile(accept_greedy)
compiled_accept_sampled_rows = {rule: mx.compile(partial(accept_sampled_rows, rule=rule))
                                for rule in ("exact", "argmax")}


def rules(rule: str, compiled: bool) -> Tuple[Callable, Callable]:
    """(accept_greedy, accept_sampled_rows with `rule`): compiled graphs or op by op."""
    if compiled:
        return compiled_accept_greedy, compiled_accept_sampled_rows[rule]
    return accept_greedy, partial(accept_sampled_rows, rule=rule)

