"""Decide how many drafts a row keeps and which token follows them.

Greedy: draft j is kept iff it equals the target's argmax at its position; the
tokens emitted are then simply the target's argmaxes up to the first mismatch.

Sampling (Leviathan et al. 2023, Chen et al. 2023): keep draft x with probability
min(1, p(x) / q(x)); at the first rejection draw from normalize(max(p - q, 0)); when
every draft is kept draw the bonus from p. p and q are the target's and the draft's
distributions AFTER the request's processors, filters and temperature, which is
what makes the output distribution exactly the target's.

Everything stays lazy on the device; the caller evaluates once per cycle.
"""

from __future__ import annotations

from typing import Optional, Tuple

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
    k = drafts.shape[0]
    k_accept, k_resid = mx.random.split(key) if key is not None else (None, None)
    idx = mx.arange(k)
    lp = p_logprobs[idx, drafts]
    lq = q_logprobs[idx, drafts]
    if rule == "exact":
        u = mx.random.uniform(shape=(k,), key=k_accept)
        accept = mx.log(u) < (lp - lq)
    elif rule == "argmax":
        accept = mx.argmax(p_logprobs[:k], axis=-1) == drafts
    else:
        raise ValueError(rule)
    kept = mx.cumprod(accept.astype(mx.int32)).sum()
    # The token after the kept drafts: residual distribution at a rejection, p for the bonus.
    p_m = mx.exp(mx.take(p_logprobs, kept, axis=0))
    q_ext = mx.concatenate([mx.exp(q_logprobs), mx.zeros((1, q_logprobs.shape[-1]), q_logprobs.dtype)])
    q_m = mx.take(q_ext, kept, axis=0)
    resid = mx.maximum(p_m - q_m, 0.0)
    # p == q makes the residual empty; then any draw from p is exact (it cannot be reached
    # with positive probability anyway, this only guards against 0/0).
    resid = mx.where(resid.sum() > 0, resid, p_m)
    nxt = mx.random.categorical(mx.log(resid), key=k_resid)
    tokens = mx.concatenate([drafts, mx.zeros((1,), drafts.dtype)])
    tokens = mx.where(mx.arange(k + 1) == kept, nxt.astype(tokens.dtype), tokens)
    return kept, tokens


def sample(logprobs: mx.array, key: Optional[mx.array]) -> mx.array:
    """Draw one token per row from log-probabilities [T, V]."""
    return mx.random.categorical(logprobs, key=key)
