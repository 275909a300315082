"""Per-request sampling: the request's processors and filters turned into the
distribution the target would sample from (exactly mlx-lm's order: logits
processors, log-softmax, top-p / min-p / top-k, then temperature).

Speculative sampling needs the distributions themselves (p for the target, q for the
draft), not only a sample, so this module returns log-probabilities; the filters are
mlx-lm's own functions.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import mlx.core as mx

from ..mlxlm.sampling import apply_min_p, apply_top_k, apply_top_p, make_logits_processors
from . import seeded
from .limits import MAX_DRAFT_DEPTH

GREEDY_BELOW = 1e-5  # temperatures and top_p below it decode greedily (SamplingParams.__post_init__)


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None
    seed: Optional[int] = None
    # With a seed: decide every token by (seed, position) alone, so the output does not
    # depend on the draft depth (engine/seeded.py). The server and `generate` set it for
    # every seeded request; off, a seed only makes the engine's draws repeatable.
    reproducible: bool = False
    logits_processors: List[Callable] = field(default_factory=list)

    def __post_init__(self):
        # A temperature or top_p this small leaves one token its probability, and float32
        # cannot compute it (1 / temperature overflows to inf, 1 - top_p rounds to 1: every
        # token masked): such a request decodes greedily, as vLLM's do below 1e-5.
        if 0 < self.temperature < GREEDY_BELOW or 0 < self.top_p < GREEDY_BELOW:
            self.temperature = 0.0

    def validate(self, vocab_size: Optional[int] = None) -> None:
        numbers = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
                   "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
                   "frequency_penalty": self.frequency_penalty}
        numbers.update({f"logit_bias[{t}]": v for t, v in (self.logit_bias or {}).items()})
        for name, value in numbers.items():
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if vocab_size is not None and self.top_k >= vocab_size:
            raise ValueError(f"top_k must be < the vocabulary size ({vocab_size})")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError("seed must be in [0, 2**64)")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in (self.logit_bias or {})):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def processors(self) -> List[Callable]:
        return list(self.logits_processors) + make_logits_processors(
            logit_bias=self.logit_bias,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )


# Temperature alone (no filter), the usual case, as single compiled graphs, as mlx-lm
# compiles its own sampler: built from separate operations (two log-softmaxes, then the
# draw) the same draw costs several more kernels per token, which shows on a small model.
# The log-softmax of the log-softmax over T is the log-softmax of logits / T. Every draw is
# argmax(x + Gumbel noise) from the row's own key (a sample of softmax(x); the noise does
# not depend on the normalisation), so a row draws the same token alone or in a batch.
@mx.compile
def tempered_logprobs(logits: mx.array, inv_temps: mx.array) -> mx.array:
    # logits [..., V] -> log-softmax(logits * inv_temps) (inv_temps broadcast on logits).
    lp = logits * inv_temps
    return lp - mx.logsumexp(lp, axis=-1, keepdims=True)


@mx.compile
def tempered_draws(logits: mx.array, inv_temps: mx.array, keys: mx.array) -> mx.array:
    # Rows of temperature-only samplers at once: logits [B, V], inv_temps [B, 1] and keys
    # [B, 2] (inverse_temperatures, next_keys) -> one draw per row [B].
    return mx.argmax(logits * inv_temps + gumbel_rows(keys, logits.shape[-1]), axis=-1)


@mx.compile
def tempered_picks(logits: mx.array, inv_temps: mx.array, keys: mx.array):
    # `tempered_draws` that also returns the log-probabilities [B, V] the draws came from
    # (a draft's q).
    lp = tempered_logprobs(logits, inv_temps)
    return mx.argmax(lp + gumbel_rows(keys, logits.shape[-1]), axis=-1), lp


_split_rows = mx.compile(mx.vmap(mx.random.split))  # keys [B, 2] -> [B, 2, 2]


def gumbel_rows(keys: mx.array, vocab: int) -> mx.array:
    """keys [B, 2] -> [B, vocab] Gumbel noise, row b's from keys[b] alone (one vectorised op)."""
    return mx.vmap(lambda key: mx.random.gumbel(shape=(vocab,), key=key))(keys)


def next_keys(samplers: Sequence["RowSampler"], offset: int = 0) -> mx.array:
    """[B, 2]: the next key of every row, as each row's `next_key` would give it, in one
    vectorised split (row by row it is a handful of ops each, paid in launches on a GPU);
    a reproducible row's is the key of its output position `offset` ahead (seeded.py)."""
    pairs = _split_rows(mx.stack([s.key for s in samplers]))
    for b, s in enumerate(samplers):
        s.key = pairs[b, 0]
    keys = pairs[:, 1]
    rows = seeded.reproducible_rows(samplers)
    if rows:
        own = seeded.position_keys([samplers[b] for b in rows], mx.array([offset]))[:, 0]
        keys = _put_rows(keys, rows, own)
    return keys


def filter_groups(samplers: Sequence["RowSampler"]) -> List[List[int]]:
    """The sampled rows with filters (top-p, min-p, top-k), grouped by (temperature, top_p,
    min_p, top_k): mlx-lm's filters take one value per call, and the agents of a batch
    usually share theirs, so a group is filtered by one call for all its rows (a GPU pays
    every operation in launches, row by row it paid each row's)."""
    groups: dict = {}
    for b, s in enumerate(samplers):
        if s.filtered and not s.params.greedy:
            groups.setdefault(s.filter_key, []).append(b)
    return list(groups.values())


def any_tempered(samplers: Sequence["RowSampler"]) -> bool:
    """Whether some row samples at a temperature without filters (the compiled steps' rows)."""
    return any(not s.filtered and not s.params.greedy for s in samplers)


def with_filtered_rows(lp: mx.array, logits: mx.array, samplers: Sequence["RowSampler"]) -> mx.array:
    """lp [B, ..., V] float32 with each filtered row's replaced by its own sampler's
    `logprobs` of logits [B, ..., V] (the same numbers alone or in any batch)."""
    for rows in filter_groups(samplers):
        lp = _put_rows(lp, rows, samplers[rows[0]].logprobs(_rows(logits, rows)).astype(lp.dtype))
    return lp


def filtered_picks(logits: mx.array, samplers: Sequence["RowSampler"], keys: mx.array, toks: mx.array,
                   lp: Optional[mx.array] = None):
    """Draws [B] (and their log-probabilities [B, V]) of a batch, with each filtered row's
    replaced by what its own sampler's `pick` draws from logits [B, V] with keys [B, 2]."""
    for rows in filter_groups(samplers):
        lp_g = samplers[rows[0]].logprobs(_rows(logits, rows)).astype(mx.float32)
        toks = _put_rows(toks, rows, mx.argmax(lp_g + gumbel_rows(_rows(keys, rows), logits.shape[-1]), axis=-1))
        if lp is not None:
            lp = _put_rows(lp, rows, lp_g)
    return toks, lp


def _rows(x: mx.array, rows: List[int]) -> mx.array:
    return x if rows == list(range(x.shape[0])) else x[mx.array(rows)]


def _put_rows(x: mx.array, rows: List[int], values: mx.array) -> mx.array:
    """x with x[rows] = values (all of x when `rows` is every row: no scatter)."""
    if rows == list(range(x.shape[0])):
        return values.astype(x.dtype)
    x[mx.array(rows)] = values
    return x


def inverse_temperatures(samplers: Sequence["RowSampler"]) -> mx.array:
    """[B, 1] float32: 1 / temperature per row (1 for a greedy row, whose draw is not used)."""
    return mx.array([[1.0 / s.params.temperature if s.params.temperature > 0 else 1.0] for s in samplers],
                    dtype=mx.float32)


# The most tokens beyond a row's own that a context of a cycle built on it holds: a cycle
# not read yet (its drafts and bonus token) and this cycle's drafts.
CYCLE_REACH = 2 * (MAX_DRAFT_DEPTH + 1)


class RowSampler:
    """Sampling state of one request: its processors, filters and random key."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.procs = params.processors()
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.key = mx.random.key(seed)  # split for every draw (`next_key`, `next_keys`)
        # A reproducible row keys its draws by output position instead (seeded.py):
        # `position` counts the tokens decided so far (an array, moved by cycles not read yet).
        self.reproducible = params.reproducible and params.seed is not None and not params.greedy
        self.base_key, self.position = self.key, mx.array(0, dtype=mx.uint32)
        self.filtered = 0 < params.top_p < 1.0 or params.min_p != 0.0 or params.top_k > 0
        # Rows without processors are drafted and decided together (verify.accept): the
        # temperature-only ones by one compiled step (`tempered_picks`), filtered ones by
        # one call per group of equal settings (`filter_groups`).
        self.filter_key = (params.temperature, params.top_p, params.min_p, params.top_k)
        self._inv_temps = inverse_temperatures([self])
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
            return seeded.position_keys([self], offset + mx.arange(n))[0]
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
