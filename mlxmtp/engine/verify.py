"""Verification: which drafts each row keeps and which tokens it emits, for a batch that
mixes greedy and sampled rows; and the per-row sampling that drafts and first tokens use.

The verify forward gives the target's logits at every drafted position of every row
([B, k+1, V]). A batch of greedy rows without logits processors is decided by one
batched argmax (rejection_sampler.accept_greedy). A batch whose sampled rows have a
temperature and nothing else (no filter, no processor: the usual sampled request) makes
every row's p and random numbers in single vectorised steps, each row's numbers from its
own key. Otherwise each row first runs its own code (its processors see its own context;
a sampled row makes its p and draws its random numbers from its own key). Then one
vectorised step decides every row: greedy rows by argmax, sampled rows by rejection
sampling against the distribution q their drafts were drawn from (the `draft_picker`
below draws them from the same processed distribution the verifier's p comes from, the
same two ways), reproducible rows by argmax agreement under positional noise (seeded.py).
Both ways give a row the same tokens; all stays lazy, evaluated with the verify forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx

from . import seeded
from .failures import blame
from .rejection_sampler import rows_noise, rules
from .sampling import (
    RowSampler,
    any_tempered,
    filtered_picks,
    inverse_temperatures,
    next_keys,
    tempered_draws,
    tempered_logprobs,
    tempered_picks,
    with_filtered_rows,
)
from .state import Row


@dataclass
class VerifyMetadata:
    """What the accept step needs about one cycle's batch, besides the target's logits.

    In the manner of vLLM's SpecDecodeMetadata. B rows in batch order, k drafts per row
    (the cycle's depth, the same for every row; 0 in plain decoding), V the vocabulary.
    """

    # [B, k] int32: the drafted tokens, row b's in drafts[b]; shape [B, 0] when k = 0.
    drafts: mx.array
    # [B, k, V]: the log-probabilities each sampled row's drafts were drawn from (q, after
    # the row's processors, filters and temperature; a greedy row's are not read); None when
    # no row samples, or k = 0.
    draft_logprobs: Optional[mx.array]
    # B entries: each row's processors, filters, temperature and random key (they make p).
    samplers: List[RowSampler]
    # B entries: each row's tokens so far (prompt + generated): what its logits processors
    # see before the first verified position (the drafts are appended for later ones).
    contexts: List[List[int]]
    # B entries: the request a failure in a row's own code (processors, sampler) is blamed on.
    request_ids: List[int]
    # None: no row asked for logprobs. Else the widest top-n any row asked for: every row
    # gets a table of that width (see logprob_table); each reads only its own top-n.
    top_logprobs: Optional[int]
    # The acceptance rule of sampled rows (rejection_sampler.accept_sampled).
    rule: str = "exact"
    # Run the acceptance rules as compiled graphs (rejection_sampler.rules).
    compiled: bool = False

    @classmethod
    def for_rows(cls, rows: List[Row], drafts: mx.array, draft_logprobs: Optional[mx.array],
                 rule: str, compiled: bool = False) -> "VerifyMetadata":
        want_lp = any(r.req.logprobs is not None for r in rows)
        top_n = max((r.req.logprobs or 0) for r in rows)
        return cls(drafts, draft_logprobs, [r.sampler for r in rows], [r.tokens for r in rows],
                   [r.req.id for r in rows], top_n if want_lp else None, rule, compiled)

    @property
    def num_drafts(self) -> int:
        return self.drafts.shape[1]

    @property
    def all_greedy(self) -> bool:
        return _plain_greedy(self.samplers, self.contexts)


def _plain_greedy(samplers: List[RowSampler], contexts: List[List[int]]) -> bool:
    """Every row greedy and without live logits processors: one batched argmax decides them all."""
    return all(s.params.greedy and not s.live(len(c)) for s, c in zip(samplers, contexts))


def accept(meta: VerifyMetadata, logits: mx.array) -> Tuple[mx.array, mx.array, Optional[mx.array]]:
    """Target logits [B, k+1, V] -> (kept drafts [B], tokens [B, k+1] int32, logprob tables
    [B, k+1, 1 + 2 * top_logprobs] or None). Row b emits tokens[b, : kept[b] + 1]."""
    B, k = logits.shape[0], meta.num_drafts
    if meta.all_greedy:
        if k == 0:
            tokens = mx.argmax(logits, axis=-1)
            kept = mx.zeros((B,), dtype=mx.int32)
        else:
            kept, tokens = rules(meta.rule, meta.compiled)[0](logits, meta.drafts)
        tables = logprob_table(logits, tokens, meta.top_logprobs) if meta.top_logprobs is not None else None
        return kept, tokens.astype(mx.int32), tables
    if not any(sm.live(len(c)) for sm, c in zip(meta.samplers, meta.contexts)):
        kept, tokens, tables = _accept_vectorised(meta, logits)
        seeded.advance(meta.samplers, kept)
        return kept, tokens, tables
    lg, p_rows, noise = [], [], []
    for b in range(B):  # each row's own code: processors, its p and random numbers
        with blame(meta.request_ids[b]):
            lg_b, p_b, noise_b = _prepare_row(meta, b, logits[b])
        lg.append(lg_b)
        p_rows.append(p_b)
        noise.append(noise_b)
    lg = mx.stack(lg)
    if k == 0:
        kept = mx.zeros((B,), dtype=mx.int32)
        tokens = mx.stack([p_b if p_b is not None else mx.argmax(lg[b], axis=-1) for b, p_b in enumerate(p_rows)])
    else:
        kept, tokens = _accept_mixed(meta, lg, p_rows, noise)
    tokens = tokens.astype(mx.int32)
    tables = logprob_table(lg, tokens, meta.top_logprobs) if meta.top_logprobs is not None else None
    seeded.advance(meta.samplers, kept)
    return kept.astype(mx.int32), tokens, tables


def _accept_vectorised(meta: VerifyMetadata, logits: mx.array):
    """`accept` for a batch of rows without processors (the usual sampled batch: greedy,
    temperature-only and filtered rows): every row's p, random numbers and decision in
    single vectorised steps (filtered rows' p: one call per group, sampling.filter_groups),
    the same rules as row by row (each row's numbers from its own key)."""
    B, k, V = logits.shape[0], meta.num_drafts, logits.shape[-1]
    inv_temps, keys = inverse_temperatures(meta.samplers), next_keys(meta.samplers)
    greedy = [sm.params.greedy for sm in meta.samplers]
    tempered = any_tempered(meta.samplers)  # else the filtered rows' steps alone
    if k == 0:
        base = tempered_draws(logits[:, 0], inv_temps, keys) if tempered else mx.zeros((B,), mx.uint32)
        draws, _ = filtered_picks(logits[:, 0], meta.samplers, keys, base)
        kept, tokens = mx.zeros((B,), dtype=mx.int32), draws[:, None]
        if any(greedy):
            tokens = mx.where(mx.array(greedy)[:, None], mx.argmax(logits, axis=-1), tokens)
    else:
        accept_greedy = rules(meta.rule, meta.compiled)[0]
        base = tempered_logprobs(logits, inv_temps[:, :, None]) if tempered else mx.zeros(logits.shape, mx.float32)
        p = with_filtered_rows(base, logits, meta.samplers)
        kept, tokens = _decide_sampled(meta, p, lambda: rows_noise(keys, k, V))
        if any(greedy):
            kept_g, tokens_g = accept_greedy(logits, meta.drafts)
            mask = mx.array(greedy)
            kept, tokens = mx.where(mask, kept_g, kept), mx.where(mask[:, None], tokens_g, tokens)
    tokens = tokens.astype(mx.int32)
    tables = logprob_table(logits, tokens, meta.top_logprobs) if meta.top_logprobs is not None else None
    return kept.astype(mx.int32), tokens, tables


def _prepare_row(meta: VerifyMetadata, b: int, lg: mx.array):
    """Row b's part of a mixed batch, logits [k+1, V] -> (its processed logits, then for a
    sampled row: with k = 0 its drawn token, else its p log-probabilities; and its random
    numbers (rejection_sampler.row_noise); None where the row is greedy)."""
    s, drafts, k = meta.samplers[b], meta.drafts[b], meta.num_drafts
    if s.live(len(meta.contexts[b])):
        base = s.context(meta.contexts[b])
        lg = s.process(lg, [mx.concatenate([base, drafts[:j]]) for j in range(k + 1)])
    if s.params.greedy:
        return lg, None, None
    if k == 0:
        return lg, s.draw(lg), None
    if s.reproducible:  # decided by its own noise (seeded.py): no rejection-sampling numbers
        return lg, s.logprobs(lg), None
    u, g = rows_noise(s.next_key()[None], k, lg.shape[-1])
    return lg, s.logprobs(lg), (u[0], g[0])


def _accept_mixed(meta: VerifyMetadata, lg: mx.array, p_rows: list, noise: list):
    """One vectorised accept for greedy and sampled rows together: greedy rows keep drafts
    that match the argmax of their (processed) logits, sampled rows by rejection sampling
    against the q their drafts came from; each row's result is picked by its kind."""
    drafts, k = meta.drafts, meta.num_drafts
    sampled = [p is not None for p in p_rows]
    kept, tokens = rules(meta.rule, meta.compiled)[0](lg, drafts)
    if any(sampled):
        V = lg.shape[-1]
        # float32, as in the vectorised accept: a row decides alike in either kind of batch.
        p = mx.stack([p_b.astype(mx.float32) if p_b is not None else mx.zeros((k + 1, V), mx.float32)
                      for p_b in p_rows])
        kept_s, tokens_s = _decide_sampled(meta, p, lambda: (
            mx.stack([n[0] if n is not None else mx.ones((k,)) for n in noise]),
            mx.stack([n[1] if n is not None else mx.zeros((V,)) for n in noise])))
        mask = mx.array(sampled)
        kept = mx.where(mask, kept_s, kept)
        tokens = mx.where(mask[:, None], tokens_s, tokens)
    return kept, tokens


def _decide_sampled(meta: VerifyMetadata, p: mx.array, noise):
    """Sampled rows' (kept [B], tokens [B, k+1]) from p [B, k+1, V]: rejection sampling with
    `noise()` -> (u, g), then reproducible rows by seeded.decide (alone when all are)."""
    B, k = meta.drafts.shape
    if all(s.params.greedy or s.reproducible for s in meta.samplers):
        kept, tokens = mx.zeros((B,), mx.int32), mx.zeros((B, k + 1), mx.int32)
    else:
        u, g = noise()
        accept_sampled_rows = rules(meta.rule, meta.compiled)[1]
        kept, tokens = accept_sampled_rows(p, meta.draft_logprobs.astype(p.dtype), meta.drafts, u, g)
    return seeded.decide(meta.samplers, p, meta.drafts, kept, tokens)


def draft_picker(rows: List[Row]):
    """How the proposer decides each draft of `rows` (see proposers/mtp_head.draft): the argmax for
    greedy rows, a sample from the row's processed distribution (and that q) for sampled ones."""
    return picker([r.sampler for r in rows], [r.tokens for r in rows], [r.req.id for r in rows])


def picker(samplers: List[RowSampler], contexts: List[List[int]], request_ids: List[int]):
    """`draft_picker` for rows given by their samplers, contexts (tokens so far: what their
    processors see) and the requests their failures are blamed on. A pick returns the
    drafts [B] and the log-probabilities [B, V] they were drawn from (None: all greedy)."""
    if _plain_greedy(samplers, contexts):
        return lambda step, logits, so_far: (mx.argmax(logits, axis=-1), None)
    if not any(s.live(len(c)) for s, c in zip(samplers, contexts)):
        return _vectorised_picker(samplers)

    def pick(step, logits, so_far):
        toks, qs = [], []
        for b, s in enumerate(samplers):
            with blame(request_ids[b]):
                tok, q = _pick_row(s, contexts[b], logits[b : b + 1], so_far[b])
            toks.append(tok)
            qs.append(q if q is not None else mx.zeros(logits.shape[-1:], mx.float32))
        return mx.stack(toks), mx.stack(qs)

    return pick


def _vectorised_picker(samplers: List[RowSampler]):
    """The picker of rows without processors: every row's draft in one compiled step
    (sampling.tempered_picks), filtered rows' replaced by their groups' draws
    (sampling.filtered_picks), greedy rows' by their argmax."""
    inv_temps = inverse_temperatures(samplers)
    greedy = mx.array([s.params.greedy for s in samplers]) if any(s.params.greedy for s in samplers) else None
    tempered = any_tempered(samplers)  # else the filtered rows' steps alone

    def pick(step, logits, so_far):
        keys = next_keys(samplers, offset=step)
        if tempered:
            base = tempered_picks(logits, inv_temps, keys)
        else:
            base = mx.zeros(logits.shape[:1], mx.uint32), mx.zeros(logits.shape, mx.float32)
        toks, lp = filtered_picks(logits, samplers, keys, *base)
        if greedy is not None:
            toks = mx.where(greedy, mx.argmax(logits, axis=-1), toks)
        return toks, lp

    return pick


def _pick_row(s: RowSampler, context: List[int], logits: mx.array, so_far: mx.array):
    """One draft of one row from the head's logits [1, V]: (token, q log-probs or None)."""
    if s.live(len(context)):
        ctx = mx.concatenate([s.context(context), so_far])
        logits = s.process(logits, [ctx])
    if s.params.greedy:
        return mx.argmax(logits, axis=-1)[0], None
    tok, lp = s.pick(logits, offset=so_far.shape[-1])
    return tok[0], lp[0]


def sample_first(row: Row, logits: mx.array) -> int:
    """A row's first token, from the prompt's last logits [1, V] (as in plain decoding);
    keeps its logprob table in row.first_lp when the request asked for logprobs."""
    lg = logits
    if row.sampler.live(len(row.tokens)):
        lg = row.sampler.process(lg, [row.sampler.context(row.tokens)])
    if row.sampler.params.greedy:
        tok = mx.argmax(lg, axis=-1)
    else:
        tok = row.sampler.draw(lg)
        seeded.advance([row.sampler], mx.zeros((1,), mx.int32))
    if row.req.logprobs is not None:
        row.first_lp = logprob_table(lg, tok, row.req.logprobs)[0].tolist()
    return int(tok.item())


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
