"""One decode cycle for every active row: launch, then commit.

Launch builds the whole cycle lazily: the drafter proposes k drafts per row (a
`proposers.base.Proposer`; the MTP head chains them), the main model verifies every row's
k+1 tokens in ONE forward, and each row keeps its own number of drafts (verify; ragged
acceptance). Commit reads the results (the cycle's one host synchronisation) and rolls
every cache back to exactly the tokens each row consumed: attention caches trim per row
in O(1); Gated DeltaNet state is rebuilt per row from what the verify recorded
(gdn_capture); no second forward.

Plain decoding (k = 0) is pipelined as mlx-lm does it: a cycle's forward is queued on
the device before the previous cycle's tokens are read (`BatchGenerator._decode_cycle`).
With `pipeline_drafts` (shape-stable caches), drafting cycles are pipelined the same way:
`launch_after` builds the next cycle from the previous one's results while they are still
on the device (its rollback, its head inputs and its last token as arrays), so the host
builds a cycle while the device computes the one before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import mlx.core as mx

from ..mlxlm import adapter, gdn_capture
from ..mlxlm.model_cache import ModelCache
from .pieces import ModelPieces
from .policy.base import cost_kind
from .sampling.accept import VerifyMetadata, accept
from .sampling.batch import BatchSampling
from .state import Batch, Row, acceptance_classes


@dataclass
class Cycle:
    """One decode cycle's lazily built results, read by `BatchGenerator._finish`."""

    rows: List[Row]
    k: int
    kept: mx.array  # [B] drafts kept per row
    tokens: mx.array  # [B, k+1]; row b emits tokens[b, : kept[b] + 1]
    lps: Optional[mx.array]  # [B, k+1, 1 + 2n] logprob tables (see sampling/logprobs.py), or None
    hidden: mx.array  # [B, k+1, H] head inputs
    records: list  # Gated DeltaNet per-position states of the verify
    t0: float
    pipelined: bool  # its input is the previous cycle's unread token
    # Per row: (the drafter that made its drafts, how many it made; the rest to k padding).
    drafted: List[Tuple[str, int]] = field(default_factory=list)
    synchronous: bool = False  # evaluated and read in the call that built it
    built: float = 0.0  # graph built (synchronous cycles)
    computed: float = 0.0  # device done (synchronous cycles)
    # [B, k] each draft's chance of being kept once reached (sampling/accept.keep_chances):
    # what the depth policy learns acceptance from; None where no row samples.
    chances: Optional[mx.array] = None

    def select(self, keep: List[int]) -> "Cycle":
        idx = mx.array(keep, dtype=mx.int32)
        return Cycle([self.rows[i] for i in keep], self.k, self.kept[idx], self.tokens[idx],
                     None if self.lps is None else self.lps[idx], self.hidden[idx],
                     [r.select(idx) for r in self.records], self.t0, self.pipelined,
                     [self.drafted[i] for i in keep] if self.drafted else [],
                     chances=None if self.chances is None else self.chances[idx])


def choose_depth(policy, rows: List[Row], proposer) -> Tuple[int, str]:
    """The next cycle's depth, and why (request stats and /metrics report it): the depth
    policy's, or the drafter's plan on top of it (Proposer.plan)."""
    if proposer is None:
        return 0, "no MTP head"
    limit = room(rows)
    pinned = [r.req.num_draft for r in rows if r.req.num_draft is not None]
    if pinned:  # a request that pins its depth gets it (the smallest pin wins in a batch)
        k, why = max(0, min(min(pinned), limit)), "pinned by a request"
    else:
        classes, requests = acceptance_classes(rows), [r.req.id for r in rows]
        for row, cls in zip(rows, classes):
            if row.stats.forwards == 0:  # its first cycle (a pipelined engine may ask twice)
                policy.request_started(cls, row.req.id)
        k, why = policy.choose(len(rows), limit, classes, requests), policy.why
    k = proposer.plan(rows, k, policy, limit)
    return k, proposer.why() or why


def cost_kind_of(rows: List[Row]) -> str:
    """Which kind of cost table prices these rows' cycles (policy.base.cost_kind)."""
    return cost_kind(acceptance_classes(rows))


def can_pipeline(rows: List[Row], k: int, pipeline_drafts: bool, proposer) -> bool:
    """Whether the next cycle may be queued on the device and read in the next step, after
    the one after it is queued: not where a logits processor needs each token on the host;
    a drafting cycle only with `pipeline_drafts` and a plan that needs no tokens on the host
    (Proposer.needs_host_tokens)."""
    return all(not r.sampler.live(len(r.tokens)) for r in rows) and (
        k == 0 or (pipeline_drafts and not proposer.needs_host_tokens()))


def room(rows: List[Row]) -> int:
    """The most drafts worth making for `rows`. Drafting past a row's max_tokens is wasted
    but harmless (the stop truncates it); capping by the row with the most room keeps one
    finishing row from stalling drafting."""
    return max(r.req.max_tokens - r.generated - 1 for r in rows)


def first_inputs(rows: List[Row], after: Optional[Cycle]) -> mx.array:
    """[B, 1]: each row's last token, not yet fed to the main model."""
    if after is not None:  # the previous (unread) cycle's tokens are this one's inputs
        return after.tokens[:, :1]
    return mx.array([r.y for r in rows], dtype=mx.int32)[:, None]


def wait_for_drafts(drafts: mx.array, q: Optional[mx.array]) -> float:
    """Evaluate the drafts (and their q log-probabilities) on their own (profiling) -> seconds."""
    t = time.perf_counter()
    mx.eval(drafts, *([q] if q is not None else []))
    return time.perf_counter() - t


def verify(pieces: ModelPieces, cache: ModelCache, rows: List[Row], ys: mx.array, drafts: mx.array,
           q: Optional[mx.array], rule: str, t0: float, pipelined: bool, sampling: BatchSampling,
           drafted: Optional[List[Tuple[str, int]]] = None) -> Cycle:
    """Build the verify forward over [ys, drafts] ([B, k+1]) and the acceptance, lazily;
    `sampling`: the cycle's, which its drafts were picked with."""
    k = drafts.shape[1]
    records = []
    if k > 0:
        inputs = mx.concatenate([ys, drafts], axis=1)
        with gdn_capture.record() as rec:
            logits, hidden = adapter.forward(pieces.parts, inputs, cache, pieces.hidden_state)
        records = rec.layers
    else:
        logits, hidden = adapter.forward(pieces.parts, ys, cache, pieces.hidden_state)
    kept, tokens, lps, chances = accept(VerifyMetadata.for_rows(rows, drafts, q, rule, pieces.compiled, sampling),
                                        logits)
    return Cycle(rows, k, kept, tokens, lps, hidden, records, t0, pipelined, drafted or [], chances=chances)


def evaluate(rec: Cycle, batch: Batch) -> None:
    """Compute a synchronous cycle now, timing the device's part."""
    # The caches are evaluated with the tokens: the work is due anyway, and leaving it
    # lazy would bill this cycle's cost to the next one (and skew the depth policy).
    rec.built, rec.synchronous = time.perf_counter(), True
    mx.eval(rec.kept, rec.tokens, *_results(rec),
            *batch.cache.arrays(), *(batch.head_cache.arrays() if batch.head_cache else []))
    rec.computed = time.perf_counter()


def start(rec: Cycle) -> None:
    """Queue a pipelined cycle on the device without waiting for it."""
    mx.async_eval(rec.tokens, rec.kept, *_results(rec))


def _results(rec: Cycle) -> list:
    """The cycle's arrays read on the host besides its kept counts and tokens."""
    return [a for a in (rec.lps, rec.chances) if a is not None]


def read(rec: Cycle) -> Tuple[List[int], List[List[int]], Optional[list]]:
    """The cycle's results on the host: (kept per row, tokens per row, logprob tables or None)."""
    # k = 0 keeps nothing by definition: no device read (an unevaluated array read here
    # would wait behind the next cycle already queued on the device).
    kept = rec.kept.tolist() if rec.k else [0] * len(rec.rows)
    return kept, rec.tokens.tolist(), rec.lps.tolist() if rec.lps is not None else None


def keep_chances(rec: Cycle) -> Optional[List[List[float]]]:
    """Per row, each draft's chance of being kept once reached (after `read`); None where
    no row samples (the drafts kept tell it) and in plain decoding."""
    return rec.chances.tolist() if rec.chances is not None else None


def roll_back(rec: Cycle, batch: Batch, consumed: List[int]) -> None:
    """Roll the main model's caches back to exactly the tokens each row consumed (y plus the
    kept drafts); the drafter's state is the proposer's (Proposer.after_verify)."""
    batch.cache.commit(rec.records, consumed, rec.k + 1)


def launch_after(pieces: ModelPieces, batch: Batch, prev: Cycle, k: int, proposer, pick, hook,
                 rule: str, sampling: BatchSampling) -> Cycle:
    """Build a drafting cycle of depth k on top of `prev` (a drafting cycle not read yet):
    prev's rollback (attention trims deferred, Gated DeltaNet states from its kept counts),
    the proposer's drafts from prev's unread results (Proposer.propose_unread), the verify
    and the acceptance, all lazily. `hook(rows, drafts, unread)`: the engine's draft hook,
    or None."""
    t0 = time.perf_counter()
    B = len(prev.rows)
    consumed = prev.kept + 1
    batch.cache.commit_unread(prev.records, consumed, prev.k + 1)
    ys = prev.tokens[mx.arange(B), prev.kept][:, None]
    drafts, q = proposer.propose_unread(batch, prev, k, pick)
    if hook is not None:
        drafts = hook(prev.rows, drafts, consumed)
    return verify(pieces, batch.cache, prev.rows, ys, drafts, q, rule, t0, True, sampling, proposer.drafted(B, k))


def settle(prev: Cycle, batch: Batch, proposer, kept: List[int]) -> None:
    """prev was rolled back by the cycle built after it (launch_after): now that its kept
    counts are read, settle the trims that cycle deferred (the main model's, the drafter's)."""
    batch.cache.settle([prev.k - n for n in kept])
    proposer.settle(batch, prev, kept)
