"""Reproducible sampling: a seeded request's tokens depend on its seed, not on the depth.

Rejection sampling (rejection.py) gives the target's distribution, but which
sample comes out depends on how the random numbers were spent: k drafts and their accept
tests at one depth, one draw per token at another. The depth policy changes the depth with
the load, so a seeded request would give other text from one run to the next.

A reproducible row (`SamplingParams.reproducible` with a seed, as the server and
`generate` make every seeded request) instead takes the token at output position n as
argmax(log p_n + G_n), G_n Gumbel noise keyed by (seed, n): a sample of p_n (the
Gumbel-max trick), by the same rule with or without drafts. Its drafts take the same
noise on the head's distribution, argmax(log q_n + G_n), and are kept while they equal the
target's token: greedy verification of perturbed log-probabilities. What the drafts are
never changes the output, so it is plain decoding's with that seed at every depth, batch
and pipelining. Shared noise keeps a draft somewhat less often than rejection sampling
would (it couples p and q well, not maximally), which is why unseeded requests keep
rejection sampling.
"""

from __future__ import annotations

from typing import List, Sequence

import mlx.core as mx

from .rejection import accept_greedy

# The first half of the key a position is hashed with (any constant: it only has to differ
# from the keys of seeds, so that position n's noise is not another seed's).
_POSITION_SALT = 0x9E3779B9


def _position_hash(position: mx.array) -> mx.array:
    return mx.random.split(mx.stack([mx.array(_POSITION_SALT, mx.uint32), position]))[0]


_hash_positions = mx.vmap(mx.vmap(_position_hash))  # [R, n] uint32 -> [R, n, 2]


def reproducible_rows(samplers: Sequence) -> List[int]:
    return [b for b, s in enumerate(samplers) if s.reproducible]


def position_keys(samplers: Sequence, offsets: mx.array) -> mx.array:
    """[R, n, 2]: the keys of output positions position + offsets[j] (offsets [n]) of each
    reproducible sampler: its seed's key XOR a hash of the position."""
    bases = mx.stack([s.base_key for s in samplers])
    positions = mx.stack([s.position for s in samplers])[:, None] + offsets.astype(mx.uint32)[None]
    return bases[:, None, :] ^ _hash_positions(positions)


def position_gumbels(samplers: Sequence, n: int, vocab: int) -> mx.array:
    """[R, n, vocab]: each sampler's noise G at its next n output positions."""
    keys = position_keys(samplers, mx.arange(n))
    return mx.vmap(mx.vmap(lambda key: mx.random.gumbel(shape=(vocab,), key=key)))(keys)


def decide(samplers: Sequence, p_logprobs: mx.array, drafts: mx.array, kept: mx.array, tokens: mx.array):
    """(kept [B], tokens [B, k+1]) with each reproducible row's replaced by greedy
    verification of its p_logprobs [B, k+1, V] (float32) perturbed by its noise."""
    rows = reproducible_rows(samplers)
    if not rows:
        return kept, tokens
    idx = mx.array(rows)
    noise = position_gumbels([samplers[b] for b in rows], p_logprobs.shape[1], p_logprobs.shape[-1])
    kept_r, tokens_r = accept_greedy(p_logprobs[idx] + noise, drafts[idx])
    kept, tokens = mx.array(kept), mx.array(tokens)
    kept[idx] = kept_r.astype(kept.dtype)
    tokens[idx] = tokens_r.astype(tokens.dtype)
    return kept, tokens


@mx.compile
def coupled_chances(p: mx.array, q: mx.array, drafts: mx.array) -> mx.array:
    """[R, k]: each draft's chance of being kept under shared noise, given the draft:
    P(argmax(log p + G) = x | argmax(log q + G) = x) for reproducible rows' log-probabilities
    p [R, k, V] (the target's at the drafted positions), q [R, k, V] (the draft's; a point
    mass for a model-free draft) and drafts x [R, k].

    Given x, the noise's maximum M = log q(x) + G(x) is a standard Gumbel (independent of
    x) and each other log q(j) + G(j) a Gumbel truncated below M; the target keeps x when
    every G(j) < M - log q(x) + log p(x) - log p(j), which given M happens with probability
    exp(-e^-M S), S = sum_j max(0, p(j) q(x) / p(x) - q(j)). As e^-M is Exponential(1),
    the chance is 1 / (1 + S) = p(x) / (p(x) + sum_j max(0, p(j) q(x) - q(j) p(x))): the
    outcome's mean without the noise's coin (a point-mass draft's chance is p(x)).
    """
    P, Q = mx.exp(p), mx.exp(q)
    px = mx.take_along_axis(P, drafts[..., None], axis=-1)
    qx = mx.take_along_axis(Q, drafts[..., None], axis=-1)
    over = mx.maximum(P * qx - Q * px, 0.0).sum(axis=-1)
    return px[..., 0] / (px[..., 0] + over)


def advance(samplers: Sequence, kept: mx.array) -> None:
    """Move each reproducible sampler past the kept[b] + 1 tokens its row emits this cycle
    (lazily: a pipelined cycle's next one is keyed before this one is read)."""
    rows = reproducible_rows(samplers)
    if not rows:
        return
    emitted = kept.astype(mx.uint32) + 1  # one op for the batch, then a slice per row
    for b in rows:
        samplers[b].position = samplers[b].position + emitted[b]
