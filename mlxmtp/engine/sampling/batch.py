"""One cycle's sampling, decided once for its batch (in the manner of vLLM's
`SamplingMetadata`): which rows are greedy, which sample at a temperature alone, which
need filters or run processors of their own, and so how the batch is sampled.

Every draw goes through this object: a draft pick, the token after plain decoding's
forward and a row's first token take one token per row from `sample`; the accept step
takes the target's distributions p from `target_p`. The greedy / vectorised / per-row
dispatch is written here once, and both ways give a row the same tokens (each row's
random numbers come from its own key); all stays lazy, evaluated with the cycle.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import mlx.core as mx

from ..failures import blame
from ..state import Row
from .ops import (
    gumbel_rows,
    inverse_temperatures,
    put_rows,
    split_rows,
    take_rows,
    tempered_draws,
    tempered_logprobs,
    tempered_picks,
)
from .rejection import rows_noise
from .row import RowSampler
from .seeded import position_keys

# How a batch is sampled (BatchSampling.mode).
GREEDY = "greedy"  # every row greedy, none with live processors: one batched argmax
VECTORISED = "vectorised"  # no live processors: every row's p and draws in single vectorised steps
PER_ROW = "per_row"  # some row's processors are live: each row's own code, then one vectorised decision


class BatchSampling:
    """What sampling needs to know about one cycle's batch, besides the logits: built once
    per cycle (`for_rows`), read by the draft picks and the accept step alike. B rows in
    batch order, V the vocabulary."""

    def __init__(self, samplers: List[RowSampler], contexts: List[List[int]], request_ids: List[int]):
        # B entries: each row's processors, filters, temperature and random key.
        self.samplers = samplers
        # B entries: each row's tokens so far (prompt + generated): what its processors see
        # before the first position sampled (the drafts so far are appended for later ones).
        self.contexts = contexts
        # B entries: the request a failure in a row's own code (processors, sampler) is blamed on.
        self.request_ids = request_ids
        # B entries: whether the row has processors that may change a distribution of this
        # cycle (RowSampler.live): such a row runs its own code, and the batch is PER_ROW.
        self.live = [bool(s.live(len(c))) for s, c in zip(samplers, contexts)]
        # B entries: whether the row decodes greedily (the argmax; it draws no random numbers).
        self.greedy = [s.params.greedy for s in samplers]
        # GREEDY, VECTORISED or PER_ROW (above).
        self.mode = PER_ROW if any(self.live) else GREEDY if all(self.greedy) else VECTORISED
        # The rows of reproducible samplers, keyed by output position (seeded.py).
        self.reproducible = [b for b, s in enumerate(samplers) if s.reproducible]
        # Whether no row is decided by rejection sampling (each greedy or reproducible):
        # the accept step then draws none of its random numbers.
        self.no_rejection = all(g or s.reproducible for g, s in zip(self.greedy, samplers))
        # [B] bool `greedy` as an array, to select the greedy rows' argmax; None when no
        # row is greedy, or all are (GREEDY).
        self.greedy_mask = mx.array(self.greedy) if any(self.greedy) and not all(self.greedy) else None
        vectorised = self.mode == VECTORISED
        # VECTORISED: whether some row samples at a temperature alone (no filter): the
        # compiled tempered steps run for the batch (else the filter groups' steps alone).
        self.tempered = vectorised and any(not s.filtered and not g for s, g in zip(samplers, self.greedy))
        # VECTORISED: the sampled rows with filters (top-p, min-p, top-k) grouped by equal
        # settings (RowSampler.filter_key): mlx-lm's filters take one value per call, and
        # the agents of a batch usually share theirs, so a group is filtered by one call.
        self.filter_groups = _filter_groups(samplers) if vectorised else []
        # VECTORISED: [B, 1] float32, 1 / temperature per row (1 for a greedy row); else None.
        self.inv_temps = inverse_temperatures([s.params.temperature for s in samplers]) if vectorised else None

    @classmethod
    def for_rows(cls, rows: List[Row]) -> "BatchSampling":
        return cls([r.sampler for r in rows], [r.tokens for r in rows], [r.req.id for r in rows])

    def next_keys(self, offset: int = 0) -> mx.array:
        """[B, 2]: the next key of every row, as each row's `next_key` would give it, in one
        vectorised split (row by row it is a handful of ops each, paid in launches on a GPU);
        a reproducible row's is the key of its output position `offset` ahead (seeded.py)."""
        pairs = split_rows(mx.stack([s.key for s in self.samplers]))
        for b, s in enumerate(self.samplers):
            s.key = pairs[b, 0]
        keys = pairs[:, 1]
        if self.reproducible:
            own = position_keys([self.samplers[b] for b in self.reproducible], mx.array([offset]))[:, 0]
            keys = put_rows(keys, self.reproducible, own)
        return keys

    def sample(self, logits: mx.array, so_far: mx.array, with_q: bool):
        """One token per row from logits [B, V], the position after each row's context and
        so_far [B, j] (the drafts so far; [B, 0] at the first) -> (tokens [B]; with `with_q`,
        the log-probabilities [B, V] the sampled rows' tokens came from (a draft's q), None
        when every row is greedy and none live; the processed logits [B, V] without
        `with_q`, None where they are `logits`). A reproducible row's draw is keyed j
        positions ahead of its own."""
        if self.mode == GREEDY:
            return mx.argmax(logits, axis=-1), None, None
        if self.mode == PER_ROW:
            return self._sample_rows(logits, so_far, with_q)
        keys = self.next_keys(offset=so_far.shape[-1])
        if not self.tempered:  # the filter groups' draws alone
            base = (mx.zeros(logits.shape[:1], mx.uint32), mx.zeros(logits.shape, mx.float32) if with_q else None)
        elif with_q:
            base = tempered_picks(logits, self.inv_temps, keys)
        else:
            base = tempered_draws(logits, self.inv_temps, keys), None
        tokens, q = self._filtered_picks(logits, keys, *base)
        if self.greedy_mask is not None:
            tokens = mx.where(self.greedy_mask, mx.argmax(logits, axis=-1), tokens)
        return tokens, q, None

    def pick(self, step: int, logits: mx.array, so_far: mx.array):
        """How the proposer decides each draft (see proposers/mtp_head.draft): `sample` with
        q, drafts [B, step] so far -> (tokens [B], q [B, V] or None: all greedy)."""
        tokens, q, _ = self.sample(logits, so_far, with_q=True)
        return tokens, q

    def target_p(self, logits: mx.array, drafts: mx.array):
        """The accept step's inputs from target logits [B, k+1, V] and drafts [B, k] (k > 0):
        (the processed logits [B, k+1, V]; p [B, k+1, V] float32, the distributions the
        sampled rows are decided against, None when no row samples; noise() -> (uniforms
        [B, k], Gumbels [B, V]), rejection sampling's random numbers, each row's from its key)."""
        k, V = drafts.shape[1], logits.shape[-1]
        if self.mode == GREEDY:
            return logits, None, None
        if self.mode == PER_ROW:
            return self._target_p_rows(logits, drafts)
        keys = self.next_keys()
        if self.tempered:
            p = tempered_logprobs(logits, self.inv_temps[:, :, None])
        else:  # the filter groups' rows alone
            p = mx.zeros(logits.shape, mx.float32)
        for rows in self.filter_groups:
            p = put_rows(p, rows, self.samplers[rows[0]].logprobs(take_rows(logits, rows)).astype(p.dtype))
        return logits, p, lambda: rows_noise(keys, k, V)

    def _filtered_picks(self, logits: mx.array, keys: mx.array, tokens: mx.array, q: Optional[mx.array]):
        """tokens [B] (and q [B, V]) with each filter group's rows replaced by what their
        samplers' `pick` draws from logits [B, V] with keys [B, 2]."""
        for rows in self.filter_groups:
            q_g = self.samplers[rows[0]].logprobs(take_rows(logits, rows)).astype(mx.float32)
            draws = mx.argmax(q_g + gumbel_rows(take_rows(keys, rows), logits.shape[-1]), axis=-1)
            tokens = put_rows(tokens, rows, draws)
            if q is not None:
                q = put_rows(q, rows, q_g)
        return tokens, q

    def _sample_rows(self, logits: mx.array, so_far: mx.array, with_q: bool):
        """`sample`, each row by its own code: its processors, then its argmax or its draw."""
        tokens, qs, processed = [], [], []
        for b, s in enumerate(self.samplers):
            with blame(self.request_ids[b]):
                lg = logits[b : b + 1]
                if self.live[b]:
                    lg = s.process(lg, [mx.concatenate([s.context(self.contexts[b]), so_far[b]])])
                if self.greedy[b]:
                    tok, q = mx.argmax(lg, axis=-1), None
                elif with_q:
                    tok, q = s.pick(lg, offset=so_far.shape[-1])
                else:
                    tok, q = s.draw(lg, offset=so_far.shape[-1]), None
            tokens.append(tok[0])
            if with_q:
                qs.append(q[0] if q is not None else mx.zeros(logits.shape[-1:], mx.float32))
            else:
                processed.append(lg[0])
        if with_q:
            return mx.stack(tokens), mx.stack(qs), None
        return mx.stack(tokens), None, mx.stack(processed)

    def _target_p_rows(self, logits: mx.array, drafts: mx.array):
        """`target_p`, each row by its own code (its processors see its own context and
        drafts; a sampled row makes its p and random numbers from its own key)."""
        k, V = drafts.shape[1], logits.shape[-1]
        processed, p, noise = [], [], []
        for b in range(len(self.samplers)):
            with blame(self.request_ids[b]):
                lg, p_b, noise_b = self._row_p(b, logits[b], drafts[b])
            processed.append(lg)
            p.append(p_b)
            noise.append(noise_b)
        if all(self.greedy):
            return mx.stack(processed), None, None
        # float32, as in the vectorised steps: a row decides alike in either kind of batch.
        p = [p_b.astype(mx.float32) if p_b is not None else mx.zeros((k + 1, V), mx.float32) for p_b in p]
        return mx.stack(processed), mx.stack(p), lambda: (
            mx.stack([n[0] if n is not None else mx.ones((k,)) for n in noise]),
            mx.stack([n[1] if n is not None else mx.zeros((V,)) for n in noise]))

    def _row_p(self, b: int, lg: mx.array, drafts: mx.array) -> Tuple[mx.array, Optional[mx.array], Optional[tuple]]:
        """Row b's logits [k+1, V] -> (processed logits, then, where it samples: its p and,
        unless reproducible (decided by its own noise, seeded.py), its random numbers)."""
        s, k = self.samplers[b], drafts.shape[0]
        if self.live[b]:
            base = s.context(self.contexts[b])
            lg = s.process(lg, [mx.concatenate([base, drafts[:j]]) for j in range(k + 1)])
        if self.greedy[b]:
            return lg, None, None
        if s.reproducible:
            return lg, s.logprobs(lg), None
        u, g = rows_noise(s.next_key()[None], k, lg.shape[-1])
        return lg, s.logprobs(lg), (u[0], g[0])


def _filter_groups(samplers: List[RowSampler]) -> List[List[int]]:
    """The sampled rows with filters, grouped by RowSampler.filter_key, in batch order."""
    groups: dict = {}
    for b, s in enumerate(samplers):
        if s.filtered and not s.params.greedy:
            groups.setdefault(s.filter_key, []).append(b)
    return list(groups.values())
