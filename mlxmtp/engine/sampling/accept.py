"""Verification: which drafts each row keeps and which tokens it emits, for a batch that
mixes greedy and sampled rows; and the draft picks and first tokens, sampled alike.

The verify forward gives the target's logits at every drafted position of every row
([B, k+1, V]). The cycle's `BatchSampling` (batch.py) turns them into each row's p (after
its processors, filters and temperature) and random numbers, vectorised or row by row as
it decided once for the cycle. Then one vectorised step decides every row: greedy rows by
argmax (rejection.accept_greedy), sampled rows by rejection sampling against the
distribution q their drafts were drawn from (`picker`, from the same `BatchSampling`),
reproducible rows by argmax agreement under positional noise (seeded.py). With no drafts
(plain decoding) each row's token is one `BatchSampling.sample`, as a first token is.

Each draft also gets its chance of being kept once reached (`keep_chances`), which the depth
policy learns acceptance from: under rejection sampling that is min(1, p(x) / q(x)) of the
drawn draft x, whose mean given the draft was reached is the acceptance probability itself,
without the noise of the accept-or-reject coin (a request's first few drafts estimate its
acceptance far more surely so); for reproducible rows, decided by argmax agreement under
shared noise, the chance over that noise that the target's token is the draft
(seeded.coupled_chances); for greedy rows the outcome itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx

from ..state import Row
from .batch import BatchSampling
from .logprobs import logprob_table
from .rejection import rules
from .row import RowSampler
from .seeded import advance, coupled_chances, decide


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
    # The acceptance rule of sampled rows (rejection.accept_sampled).
    rule: str = "exact"
    # Run the acceptance rules as compiled graphs (rejection.rules).
    compiled: bool = False
    # The cycle's sampling decisions over samplers, contexts and request_ids (the ones its
    # drafts were picked with); made from them when not given.
    sampling: Optional[BatchSampling] = None

    def __post_init__(self):
        if self.sampling is None:
            self.sampling = BatchSampling(self.samplers, self.contexts, self.request_ids)

    @classmethod
    def for_rows(cls, rows: List[Row], drafts: mx.array, draft_logprobs: Optional[mx.array], rule: str,
                 compiled: bool = False, sampling: Optional[BatchSampling] = None) -> "VerifyMetadata":
        want_lp = any(r.req.logprobs is not None for r in rows)
        top_n = max((r.req.logprobs or 0) for r in rows)
        return cls(drafts, draft_logprobs, [r.sampler for r in rows], [r.tokens for r in rows],
                   [r.req.id for r in rows], top_n if want_lp else None, rule, compiled, sampling)

    @property
    def num_drafts(self) -> int:
        return self.drafts.shape[1]


def accept(meta: VerifyMetadata, logits: mx.array) -> Tuple[mx.array, mx.array, Optional[mx.array], Optional[mx.array]]:
    """Target logits [B, k+1, V] -> (kept drafts [B] int32, tokens [B, k+1] int32, logprob
    tables [B, k+1, 1 + 2 * top_logprobs] or None, keep_chances [B, k] float32 or None
    where every row is greedy, in plain decoding, or under a rule other than "exact"). Row b
    emits tokens[b, : kept[b] + 1]."""
    sampling = meta.sampling
    if meta.num_drafts == 0:
        tokens, _, processed = sampling.sample(logits[:, 0], meta.drafts, with_q=False)
        kept, tokens = mx.zeros((logits.shape[0],), dtype=mx.int32), tokens[:, None]
        processed = processed[:, None] if processed is not None else logits
        chances = None
    else:
        kept, tokens, processed, chances = _decide(meta, logits)
    tokens = tokens.astype(mx.int32)
    tables = logprob_table(processed, tokens, meta.top_logprobs) if meta.top_logprobs is not None else None
    if sampling.reproducible:
        advance(sampling.samplers, kept)
    return kept, tokens, tables, chances


def _decide(meta: VerifyMetadata, logits: mx.array):
    """`accept` with drafts: (kept [B], tokens [B, k+1], the processed logits, keep_chances
    [B, k] or None). Greedy rows keep drafts that match the argmax of their (processed)
    logits, sampled rows are decided by rejection sampling against the q their drafts came
    from, reproducible rows by argmax agreement under their noise (seeded.decide); each row's
    result is picked by its kind."""
    sampling, drafts = meta.sampling, meta.drafts
    accept_greedy, accept_sampled_rows = rules(meta.rule, meta.compiled)
    processed, p, noise = sampling.target_p(logits, drafts)
    if p is None:  # every row greedy
        kept, tokens = accept_greedy(processed, drafts)
        return kept, tokens, processed, None
    q = meta.draft_logprobs.astype(p.dtype) if meta.draft_logprobs is not None else None
    if sampling.no_rejection:
        kept, tokens = mx.zeros(drafts.shape[:1], mx.int32), mx.zeros((drafts.shape[0], drafts.shape[1] + 1), mx.int32)
    else:
        u, g = noise()
        kept, tokens = accept_sampled_rows(p, q, drafts, u, g)
    kept, tokens = decide(sampling.samplers, p, drafts, kept, tokens)  # the reproducible rows
    if sampling.greedy_mask is not None:
        kept_g, tokens_g = accept_greedy(processed, drafts)
        mask = sampling.greedy_mask
        kept, tokens = mx.where(mask, kept_g, kept), mx.where(mask[:, None], tokens_g, tokens)
    if meta.rule != "exact" or q is None:
        return kept, tokens, processed, None
    by_ratio = [not (g or s.reproducible) for g, s in zip(sampling.greedy, sampling.samplers)]
    return kept, tokens, processed, keep_chances(kept, by_ratio, sampling.reproducible, p, q, drafts)


def keep_chances(kept: mx.array, by_ratio: List[bool], coupled: List[int], p: mx.array, q: mx.array,
                 drafts: mx.array) -> mx.array:
    """[B, k] float32: each draft's chance of being kept, given it was reached (read only
    where it was: draft i of row b when kept[b] >= i), from log-probabilities p [B, k+1, V]
    (the target's) and q [B, k, V] (the drafts'). Rows `by_ratio` (decided by rejection
    sampling) get min(1, p(x) / q(x)) of their draft x; the rows `coupled` (reproducible:
    decided by argmax agreement under shared noise) their chance over that noise
    (seeded.coupled_chances); the others (greedy) 1 for a kept draft, 0 for the rejected."""
    k = drafts.shape[1]
    outcome = (mx.arange(k)[None, :] < kept[:, None]).astype(mx.float32)
    rows, idx = mx.arange(drafts.shape[0])[:, None], mx.arange(k)[None, :]
    ratio = mx.exp(mx.minimum(p[rows, idx, drafts] - q[rows, idx, drafts], 0.0)).astype(mx.float32)
    chances = mx.where(mx.array(by_ratio)[:, None], ratio, outcome)
    if coupled:
        at = mx.array(coupled)
        chances[at] = coupled_chances(p[at, :k], q[at], drafts[at]).astype(mx.float32)
    return chances


def picker(samplers: List[RowSampler], contexts: List[List[int]], request_ids: List[int]):
    """The draft picker (BatchSampling.pick) of rows given by their samplers, contexts
    (tokens so far: what their processors see) and the requests their failures are blamed on."""
    return BatchSampling(samplers, contexts, request_ids).pick


def sample_first(row: Row, logits: mx.array) -> int:
    """A row's first token, from the prompt's last logits [1, V] (as in plain decoding);
    keeps its logprob table in row.first_lp when the request asked for logprobs."""
    sampling = BatchSampling.for_rows([row])
    tok, _, processed = sampling.sample(logits, mx.zeros((1, 0), mx.int32), with_q=False)
    if sampling.reproducible:
        advance(sampling.samplers, mx.zeros((1,), mx.int32))
    if row.req.logprobs is not None:
        row.first_lp = logprob_table(processed if processed is not None else logits, tok, row.req.logprobs)[0].tolist()
    return int(tok.item())
