"""The MTP head and the suffix drafter in one cycle: per row, the source whose draft promises
more tokens per unit of verify cost.

Each cycle the depth policy chooses the head's depth k (0: plain decoding). `plan` then asks
the suffix drafter for each row's proposal (suffix_index.Draft: its tokens, and probs[i], the
estimated probability that the first i + 1 are all kept; a row whose proposals went untaken
for a while is asked less often, hybrid_plan.Lookups) and picks the cycle's depth K among k
and the proposals' lengths, and the head's depth j in it (hybrid_plan.choose): the pair with
the most expected tokens per unit of cost over the batch that leaves the rows on the head at
least `fairness.FAIR_SHARE` of their own rate, each row taking at that depth the source that
expects more.

The head runs when at least one row takes its drafts, at depth j; every row's drafts
are padded to K by repeating its last one (verified like any draft: padding costs acceptance
only, never the text). When no row takes the head's drafts the head does not run: the cycle's
hidden states join the rows' pending inputs as after a plain cycle, and the head catches up
on them when it next drafts (mtp_inputs).

A cycle with suffix rows needs every row's tokens on the host: `needs_host_tokens` then tells
the engine to read the cycle in flight first (no pipelined drafting for that cycle); head-only
cycles pipeline as the head alone does. A cycle with suffix drafts teaches the depth policy
its cost (engine/timing.py), which prices the next suffix drafts, and the head's acceptance,
only from the rows that drafted with the head.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from ..suffix_index import Draft
from . import mtp_inputs
from .base import SUFFIX, Drafts, Picker, Proposer, point_mass
from .fairness import Ledger
from .hybrid_plan import (
    DEFAULT_SLOPE,
    Calibration,
    CyclePlan,
    Lookups,
    Reach,
    choose,
    forget_absent,
    head_only,
)
from .mtp import MTPProposer, drop_chained_rows
from .suffix import SuffixProposer, padded


class HybridProposer(Proposer):
    pipelines = True  # head-only cycles; a cycle with suffix rows is read first (needs_host_tokens)

    def __init__(self, head: MTPProposer, suffix: SuffixProposer, max_depth: int,
                 shape_stable: Callable[[], bool] = lambda: False):
        self.head, self.suffix = head, suffix
        self.shared_index = suffix.shared_index
        self.max_depth = max_depth  # the longest suffix draft (limits.MAX_SUFFIX_DEPTH)
        # Whether the engine's caches are shape-stable: suffix depths then round up to a few
        # buckets (hybrid_plan.SHAPE_BUCKETS).
        self.shape_stable = shape_stable
        self.calibration = Calibration()
        self.reach = Reach()
        self.lookups = Lookups()
        self.ledger = Ledger()  # each request's rate so far, for the plan's fairness (fairness.py)
        self.head_prices: Dict[Tuple[int, int], float] = {}  # (rows, depth) -> a head-only cycle's last price
        self.plan_: CyclePlan = head_only(0)  # the next cycle's (`plan`)
        # The plan of the cycle proposed last, which `after_verify` learns from. Not `plan_`: the
        # next cycle is planned before the cycle in flight is read, and a plan with suffix rows
        # drains that cycle (needs_host_tokens) before its own is proposed.
        self.launched: CyclePlan = head_only(0)
        self.drafts_made: List[Tuple[str, int]] = []  # the last cycle's, per row (`drafted`)
        self.suffix_ids: set = set()  # the requests whose last drafts were the suffix's

    # ------------------------------------------------------------ the plan
    def plan(self, rows: List, k: int, policy, limit: Optional[int]) -> int:
        self.calibration.fade()
        cap = self.max_depth if limit is None else max(0, min(self.max_depth, limit))
        if cap == 0 or any(r.req.num_draft is not None for r in rows):  # a pinned depth is the head's
            self.plan_ = head_only(k)
        else:
            looked = {r.req.id for r in rows if self.lookups.due(r.req.id)}
            proposals = [self.suffix.proposal(r, min(cap, self.reach.get(r.req.id))) if r.req.id in looked
                         else _NONE for r in rows]
            self.plan_ = choose(k, rows, proposals, policy, self.calibration, cap, self.shape_stable(),
                                self.reach, self.ledger)
            self.lookups.update(looked, set(self.plan_.suffix))
        self._charge(rows)
        return self.plan_.depth

    def _charge(self, rows: List) -> None:
        """The ledger's share of the planned cycle: its price where the plan priced it, else (no
        suffix proposal to weigh) the last price of a head-only cycle of its depth at this batch
        size. Asking the policy every cycle would add a collective per cycle across machines
        (distributed/shared_policy.py); plain decoding costs 1 by definition."""
        plan, key = self.plan_, (len(rows), self.plan_.depth)
        if plan.cost is not None and not plan.suffix:
            self.head_prices[key] = plan.cost
        cost = plan.cost if plan.cost is not None else self.head_prices.get(key, 1.0 + DEFAULT_SLOPE * plan.depth)
        self.ledger.charge(rows, cost)

    def why(self) -> Optional[str]:
        return SUFFIX if self.plan_.suffix else None

    def needs_host_tokens(self) -> bool:
        return bool(self.plan_.suffix)

    # ------------------------------------------------------------ Proposer
    def propose(self, batch, rows: List, k: int, pick: Picker) -> Drafts:
        plan = self.launched = self.plan_
        if not plan.suffix:
            self.drafts_made = [(self.head.source, k)] * len(rows)
            return self.head.propose(batch, rows, k, pick)
        head = self.head.propose(batch, rows, plan.head_depth, pick) if plan.head_depth else None
        # A suffix row's proposal again, from its tokens now (the plan may have been made
        # before the cycle in flight was read); one that finds none takes the head's drafts
        # when the head runs.
        fresh = [self.suffix.proposal(r, k).tokens[:k] if s else [] for r, s in zip(rows, plan.suffix_rows(rows))]
        own = [s and (bool(d) or head is None) for d, s in zip(fresh, plan.suffix_rows(rows))]
        self.drafts_made = [(self.suffix.source, len(d)) if o else (self.head.source, plan.head_depth if head else 0)
                            for d, o in zip(fresh, own)]
        self.suffix_ids = {r.req.id for r, o, d in zip(rows, own, fresh) if o and d}
        tokens = _assemble(fresh, own, head, rows, k)
        if all(r.sampler.params.greedy for r in rows):
            return Drafts(tokens, None)
        q = point_mass(tokens, self.suffix.vocab_size)
        if head is not None and head.logprobs is not None:  # head rows' own drafts keep the head's q
            use = mx.array([not o for o in own])[:, None, None] & (mx.arange(k) < plan.head_depth)[None, :, None]
            q = mx.where(use, mx.pad(head.logprobs, [(0, 0), (0, k - plan.head_depth), (0, 0)]), q)
        return Drafts(tokens, q)

    def propose_unread(self, batch, prev, k: int, pick: Picker) -> Drafts:
        self.launched = self.plan_  # head-only: a plan with suffix rows is never pipelined
        self.drafts_made = [(self.head.source, k)] * len(prev.rows)
        return self.head.propose_unread(batch, prev, k, pick)

    def drafted(self, n_rows: int, k: int) -> List[Tuple[str, int]]:
        return self.drafts_made if len(self.drafts_made) == n_rows else super().drafted(n_rows, k)

    def after_verify(self, batch, cycle, tokens: List[List[int]], consumed: List[int]) -> None:
        plan, self.launched = self.launched, head_only(0)
        self.suffix.after_verify(batch, cycle, tokens, consumed)
        if cycle.k == 0 or not plan.suffix:
            self.head.after_verify(batch, cycle, tokens, consumed)
            return
        # What the calibration and the rows' reach learn from: the rows whose drafts were the
        # suffix's (a planned one that found none drafted with the head).
        learned = replace(plan, suffix={i: p for i, p in plan.suffix.items() if i in self.suffix_ids})
        self.calibration.update(cycle.rows, learned, consumed)
        self.reach.update(cycle.rows, learned, consumed)
        if plan.head_depth:  # the head consumed the rows' pending inputs: the verify's states follow
            drop_chained_rows(batch, plan.head_depth, len(cycle.rows))
            mtp_inputs.after_cycle(cycle.rows, cycle.hidden, tokens, consumed, plan.head_depth)
        else:  # the head did not run: as after a plain cycle, its inputs pile up
            mtp_inputs.after_cycle(cycle.rows, cycle.hidden, tokens, consumed, 0)
            p = self.head.pieces
            mtp_inputs.keep_bounded(batch.rows, False, p.head, p.vocab, batch.head_cache)

    def drop_absent(self, present: set) -> None:
        self.suffix.drop_absent(present)
        self.reach.forget_absent(present)
        self.lookups.forget_absent(present)
        forget_absent(self.ledger.of, present)

    def settle(self, batch, prev, kept: List[int]) -> None:
        self.head.settle(batch, prev, kept)


_NONE = Draft([], [], 0)  # a row not looked up this cycle (hybrid_plan.Lookups)


def _assemble(fresh: List[List[int]], own: List[bool], head: Optional[Drafts], rows: List, k: int) -> mx.array:
    """[B, k] drafts: row b's suffix drafts where own[b], else the head's; each padded to k by
    repeating its last draft (the row's last token where it has none), on the device."""
    host = []
    for row, d, o in zip(rows, fresh, own):
        d = d if o else []
        host.append(padded(d, row, k))
    tokens = mx.array(host, dtype=mx.int32)
    if head is None:
        return tokens
    by_head = head.tokens
    if by_head.shape[1] < k:
        by_head = mx.concatenate([by_head, mx.repeat(by_head[:, -1:], k - by_head.shape[1], axis=1)], axis=1)
    return mx.where(mx.array([not o for o in own])[:, None], by_head, tokens)
