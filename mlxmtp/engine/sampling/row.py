"""One request's sampler: its processors and filters turned into the distribution the
target would sample from (exactly mlx-lm's order: logits processors, log-softmax, top-p /
min-p / top-k, then temperature), and its random key.

Speculative sampling needs the distributions themselves (p for the target, q for the
draft), not only a sample, so a sampler returns log-probabilities; the filters are
mlx-lm's own functions. A batch's rows are sampled together by batch.py.
"""

from __future__ import annotations

import os
from typing import Callable, List, Optional, Sequence

import mlx.core as mx

from ...mlxlm.sampling import apply_min_p, apply_top_k, apply_top_p, make_logits_processors
from ..limits import MAX_CYCLE_DEPTH
from .ops import (
    gumbel_rows,
    inverse_temperatures,
    tempered_draws,
    tempered_logprobs,
    tempered_picks,
)
from .params import SamplingParams
from .seeded import position_keys

# The most tokens beyond a row's own that a context of a cycle built on it holds: a cycle
# not read yet (its drafts and bonus token) and this cycle's drafts.
CYCLE_REACH = 2 * (MAX_CYCLE_DEPTH + 1)


class RowSampler:
    """Sampling state of one request: its processors, filters and random key."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.procs = list(params.logits_processors) + make_logits_processors(
            logit_bias=params.logit_bias, repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.key = mx.random.key(seed)  # split for every draw (`next_key`, BatchSampling.next_keys)
        # A reproducible row keys its draws by output position instead (seeded.py):
        # `position` counts the tokens decided so far (an array, moved by cycles not read yet).
        self.reproducible = params.reproducible and params.seed is not None and not params.greedy
        self.base_key, self.position = self.key, mx.array(0, dtype=mx.uint32)
        self.filtered = 0 < params.top_p < 1.0 or params.min_p != 0.0 or params.top_k > 0
        # Rows without processors are drafted and decided together (batch.BatchSampling):
        # the temperature-only ones by one compiled step (`tempered_picks`), filtered ones
        # by one call per group of equal settings (`filter_key`).
        self.filter_key = (params.temperature, params.top_p, params.min_p, params.top_k)
        self._inv_temps = inverse_temperatures([params.temperature])
        self._context: Optional[mx.array] = None  # see `context`

    def live(self, length: int) -> List[Callable]:
        """The processors that may change a distribution of a cycle built on a row of
        `length` tokens. One that leaves logits untouched below a context length (its
        `idle_below`: a thinking budget far from reached) is left out while no context of
        the cycle reaches it, drafts and a cycle not read yet included, so such a row is
        drafted, decided and pipelined with the rows that have none."""
        reach = length + CYCLE_REACH
        return [p for p in self.procs if reach >= getattr(p, "idle_below", 0)]

    def next_key(self):
        self.key, sub = mx.random.split(self.key)
        return sub

    def _next_keys(self, n: int, offset: int = 0) -> mx.array:
        """Keys of n draws; a reproducible row's: of its positions offset .. offset + n - 1 ahead."""
        if self.reproducible:
            return position_keys([self], offset + mx.arange(n))[0]
        return mx.stack([self.next_key() for _ in range(n)])

    def context(self, tokens: List[int]) -> mx.array:
        """The row's tokens so far (they only grow) as an array for its processors: kept from
        cycle to cycle and extended by the new tokens, as converting an agent's 100K-token
        context from a list each cycle would take milliseconds of host time."""
        have = None if self._context is None else self._context.shape[0]
        if have is None or have > len(tokens):
            self._context = mx.array(tokens, dtype=mx.int32)
        elif have < len(tokens):
            self._context = mx.concatenate([self._context, mx.array(tokens[have:], dtype=mx.int32)])
        return self._context

    def process(self, logits: mx.array, contexts: Sequence[mx.array]) -> mx.array:
        """logits [T, V] -> processed logits; row t sees the tokens in contexts[t]."""
        if not self.procs:
            return logits
        rows = []
        for t, ctx in enumerate(contexts):
            row = logits[t : t + 1]
            for proc in self.procs:
                row = proc(ctx, row)
            rows.append(row)
        return mx.concatenate(rows, axis=0)

    def logprobs(self, logits: mx.array) -> mx.array:
        """Processed logits [T, V] -> the log-distribution a sample is drawn from."""
        p = self.params
        if not self.filtered:
            return tempered_logprobs(logits, self._inv_temps)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0 < p.top_p < 1.0:
            lp = apply_top_p(lp, p.top_p)
        if p.min_p != 0.0:
            lp = apply_min_p(lp, p.min_p)
        if p.top_k > 0:
            lp = apply_top_k(lp, p.top_k)
        lp = lp * (1.0 / p.temperature)
        return lp - mx.logsumexp(lp, axis=-1, keepdims=True)

    def draw(self, logits: mx.array, offset: int = 0) -> mx.array:
        """Processed logits [T, V] -> one token per row, drawn from logprobs(logits);
        `offset`: of a reproducible row, how far ahead of its position row 0 lies."""
        if self.filtered:
            return self.pick(logits, offset)[0]
        return tempered_draws(logits, self._inv_temps, self._next_keys(logits.shape[0], offset))

    def pick(self, logits: mx.array, offset: int = 0):
        """`draw` that also returns the log-probabilities [T, V] the draws came from."""
        keys = self._next_keys(logits.shape[0], offset)
        if not self.filtered:
            return tempered_picks(logits, self._inv_temps, keys)
        lp = self.logprobs(logits)
        return mx.argmax(lp + gumbel_rows(keys, logits.shape[-1]), axis=-1), lp
