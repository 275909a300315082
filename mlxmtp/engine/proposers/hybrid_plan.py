"""How a hybrid cycle (proposers/hybrid.py) picks its depth and each row's draft source.

With E_h(j) the head's expected tokens from a cycle of depth j (the depth policy's estimate,
per row, 1 + sum of the chances each draft is kept), a row's suffix proposal expects
E_s(K) = 1 + sum over i < K of min(1, f^(i+1) * probs[i]) from a cycle of depth K, where
probs[i] is the suffix index's estimate that its first i + 1 tokens are kept and f scales
each token's chance: by what rows of the same acceptance class have actually kept
(`Calibration`), or, where higher, by the chance that a run of m tokens copied goes on
(`run_chance`; m: the match, or the row's run where the match fills the index's bound,
`Reach.evidence`). A cycle of depth K whose head rows draft j yields, per unit of cost,

    rate(K, j) = sum over rows of max(E_h(j), E_s(K)) / (c(K) + extra(j) * step),

c(K) the relative cost of a cycle of depth K at this batch (the policy's measurements,
plain decoding = 1, raised by its doubt about them for K other than k; a K deeper than any
measured costs halfway between the deepest measured one and the line through those measured,
so that a long verify that pays by a wide margin is tried rather than priced out by a steep
line through short ones, and one that pays only if it costs no more than a short one is not;
`DEFAULT_SLOPE` per draft where nothing is measured). The head's rows draft j = min(k, K), the
policy's choice, or as deep as the head goes within K: the verify covers K positions of every
row anyway, and a head step costs `step` (the slope of the head's own cycle costs, _head_step; `extra`:
the steps c(K) does not already price, _head_depths). The plan takes the (K, j) with the
highest rate among k, the proposals' lengths and the powers of two below them (a doubtful
long draft may pay cut short), leaving every row on the head enough (fairness.py: FAIR_SHARE of
its rate in the policy's own cycle, or its answer so far near plain decoding's rate); a row takes the
suffix where E_s(K) beats E_h(j). The head runs only if some row takes its drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

from ..limits import MAX_DRAFT_DEPTH
from ..policy.base import kind_of
from ..state import acceptance_classes
from ..token_index import MAX_MATCH
from .fairness import Ledger, fair

# The relative cost of each draft in a cycle where the policy has measured none: c(K) =
# 1 + DEFAULT_SLOPE * K. Pessimistic for GPUs (a verify of a few tokens costs about one),
# about right for CPUs, where the suffix must then be sure of long drafts to be chosen.
DEFAULT_SLOPE = 0.5
# The chance of each head draft being kept where the policy has no estimate.
PRIOR_ACCEPT = 0.5
# A depth other than the head's must beat it by this share: the suffix's estimates are
# estimates, and a switch to a long verify must be worth it.
MARGIN = 0.05
# A row's suffix drafts at first, and at the least after failures (`Reach`).
FIRST_REACH, MIN_REACH = 8, 4
# The shortest match a row's suffix draft may rest on beside the head: two or three tokens
# ("self.", "):\n    ") recur all over code and prose and say little about what follows,
# while text being copied matches longer with every token it copies.
MIN_MATCH = 4
# Suffix depths on shape-stable engines: a few verify shapes instead of one per length.
SHAPE_BUCKETS = (8, 16, 32)


@dataclass(frozen=True)
class CyclePlan:
    """One cycle's plan, made before the cycle in flight (if any) is read: rows are named by
    request id, since rows may leave the batch in between."""

    depth: int  # K: drafts verified per row this cycle
    head_depth: int  # drafts the head chains (0: the head does not run)
    suffix: Dict[int, List[float]]  # request id -> its suffix draft's probs (cut to the depth)
    # request id -> its Calibration key (rows drafting from the suffix): (request kind, streak)
    calibration_keys: Dict[int, Hashable]
    # c(K) + the head's extra steps, as the plan priced them (None: not priced, no suffix proposal)
    cost: Optional[float] = field(default=None, compare=False)

    def suffix_rows(self, rows: Sequence) -> List[bool]:
        return [r.req.id in self.suffix for r in rows]


def head_only(k: int) -> CyclePlan:
    return CyclePlan(k, k, {}, {})


class Calibration:
    """Per calibration key (a request kind and a streak), the share of suffix draft tokens kept
    against the share the suffix index predicted, over the tokens a verify reached (a draft rejected at its first token is
    evidence about one token, not about the rest): the index assumes a continuation seen before
    comes again, which sampling (a draft is kept with probability p(x)) and a model that writes
    something else than what it read break. The evidence fades by `decay` every cycle, drafting
    or not, so that a factor brought low recovers after a while (~1 / (1 - decay) cycles) and
    the suffix is tried again: text that did not repeat then may repeat now."""

    def __init__(self, decay: float = 0.98, prior: float = 2.0):
        self.decay, self.prior = decay, prior
        self.kept: Dict[Hashable, float] = {}
        self.predicted: Dict[Hashable, float] = {}

    def factor(self, cls: Hashable) -> float:
        return (self.kept.get(cls, 0.0) + self.prior) / (self.predicted.get(cls, 0.0) + self.prior)

    def fade(self) -> None:
        """One cycle passed."""
        for table in (self.kept, self.predicted):
            for cls in table:
                table[cls] *= self.decay

    def update(self, rows: Sequence, plan: CyclePlan, consumed: List[int]) -> None:
        """consumed[b] - 1: drafts row b kept this cycle."""
        for row, n in zip(rows, consumed):
            probs = plan.suffix.get(row.req.id)
            if probs:
                kept = min(n - 1, len(probs))
                reached = min(kept + 1, len(probs))
                chances = [p / q if q > 0 else 0.0 for p, q in zip(probs, [1.0, *probs])]
                cls = plan.calibration_keys[row.req.id]
                self.kept[cls] = self.kept.get(cls, 0.0) + kept
                self.predicted[cls] = self.predicted.get(cls, 0.0) + sum(chances[:reached])


class Reach:
    """How long a suffix draft each row may get: FIRST_REACH tokens at first, twice as many
    after a draft kept whole, half as many (at least MIN_REACH) after one rejected at its first
    token. Where a verify costs about a token a draft (a CPU), a long draft that fails costs
    many steps, and whether the model copies this text is known only once it has. Also each
    row's run: the tokens its suffix drafts have had kept whole in a row (`evidence`)."""

    def __init__(self):
        self.of: Dict[int, int] = {}  # request id -> its reach
        self.whole: Dict[int, bool] = {}  # request id -> whether its last suffix draft was kept whole
        self.run: Dict[int, int] = {}  # request id -> tokens of its suffix cycles kept whole in a row

    def get(self, request_id: int) -> int:
        return self.of.get(request_id, FIRST_REACH)

    def evidence(self, request_id: int, match_len: int) -> int:
        """How many tokens of copied text a row's proposal rests on: its match's length, and
        where the match fills the index's bound (the text matches further back than the index
        looks), the row's run if longer. A file copied for 200 tokens is better evidence that
        the next 32 follow than the 32-token match alone says (`run_chance`)."""
        if match_len < MAX_MATCH:
            return match_len
        return max(match_len, self.run.get(request_id, 0))

    def forget_absent(self, present: set) -> None:
        for table in (self.of, self.whole, self.run):
            forget_absent(table, present)

    def update(self, rows: Sequence, plan: CyclePlan, consumed: List[int]) -> None:
        for row, n in zip(rows, consumed):
            probs = plan.suffix.get(row.req.id)
            if probs:
                rid = row.req.id
                reach, whole = self.get(rid), n - 1 >= len(probs)
                self.whole[rid] = whole
                self.run[rid] = self.run.get(rid, 0) + n if whole else 0
                if whole:
                    reach *= 2
                elif n == 1:
                    reach = max(MIN_REACH, reach // 2)
                self.of[rid] = reach


class Lookups:
    """Which rows look up a suffix draft this cycle. A lookup costs a few tenths of a
    millisecond a row (binary searches and vector compares over the index): a tenth of a
    small model's cycle on a CPU. So a row whose proposals went untaken n cycles in a row is
    looked up every min(MAX_GAP, n // BACKOFF) + 1 cycles; text the model starts copying
    shows as a long match at the next lookup, at most MAX_GAP cycles late."""

    MAX_GAP, BACKOFF = 4, 4

    def __init__(self):
        self.untaken: Dict[int, int] = {}  # request id -> proposals not taken in a row
        self.wait: Dict[int, int] = {}  # request id -> cycles to go before its next lookup

    def due(self, request_id: int) -> bool:
        """Whether the row looks up a draft this cycle (one call a row and cycle)."""
        left = self.wait.get(request_id, 0)
        self.wait[request_id] = max(0, left - 1)
        return left == 0

    def update(self, looked: set, taken: set) -> None:
        """`looked`: the rows looked up this cycle; `taken`: those whose drafts the plan took."""
        for rid in looked:
            n = 0 if rid in taken else self.untaken.get(rid, 0) + 1
            self.untaken[rid], self.wait[rid] = n, min(self.MAX_GAP, n // self.BACKOFF)

    def forget_absent(self, present: set) -> None:
        forget_absent(self.untaken, present)
        forget_absent(self.wait, present)


def forget_absent(table: Dict[int, object], present: set) -> None:
    """Drops the entries of requests no longer in the batch from a per-request table."""
    for rid in [rid for rid in table if rid not in present]:
        del table[rid]


def expected(probs: Sequence[float], f: float, K: int) -> float:
    """E_s(K): the tokens a cycle of depth K yields on a suffix draft with these probs."""
    return 1.0 + sum(min(1.0, f ** (i + 1) * p) for i, p in enumerate(probs[:K]))


def run_chance(match_len: int) -> float:
    """The chance that a row whose last `match_len` tokens repeat earlier text (Reach.evidence)
    repeats the next one too, by the rule of succession (m successes: (m + 1) / (m + 2)). A
    model copying a file keeps copying until the text it writes changes; while the suffix was
    not taken (the head's drafts promised more) the calibration learns nothing of that run,
    and the head would keep drafting a few tokens a cycle where a long draft takes many."""
    return (match_len + 1) / (match_len + 2)


def _costs(policy, batch_size: int, classes: List[Hashable], depths: List[int], k: int,
           deepest: int) -> Tuple[Dict[int, float], float]:
    """(c(K) per depth, the price of one head step, `_head_step`): the head's depth k as the policy
    prices it (its choice allowed for the doubt), any other cautiously; DEFAULT_SLOPE where unknown."""
    known = policy.relative_costs(batch_size, classes, sorted({*depths, 1, max(deepest, 1)})) or {}
    doubted = policy.relative_costs(batch_size, classes, depths, cautious=True) or {}
    costs = {K: (known if K == k else doubted).get(K) or 1.0 + DEFAULT_SLOPE * K for K in depths}
    return costs, _head_step(policy, classes, known, deepest)


def _head_step(policy, classes: List[Hashable], known: Dict[int, float], deepest: int) -> float:
    """The slope of the head's own cycles of depths 1..`deepest` (a draft more: a step and a verified
    token, an upper bound of a step) in the batch size's table (`known`), else the one-row table's
    (start-up): a batch size reached later has none at first, and DEFAULT_SLOPE (0.5 plain cycles,
    an Apple GPU's ~0.06) kept rows writing new code shallow beside copying ones (BENCHMARKS.md)."""
    for line in (known, policy.relative_costs(1, classes, [1, deepest]) or {}) if deepest > 1 else ():
        if line.get(1) and line.get(deepest):
            return max(0.0, (line[deepest] - line[1]) / (deepest - 1))
    return DEFAULT_SLOPE


def _bucket(n: int, shape_stable: bool, cap: int) -> int:
    if not shape_stable or n <= 4:
        return n
    return min(next((b for b in SHAPE_BUCKETS if b >= n), n), max(cap, 4))


def _depths(k: int, proposals: Sequence, cap: int, shape_stable: bool) -> List[int]:
    out = {k}
    for p in proposals:
        n = min(len(p.tokens), cap)
        out |= {d for d in (1, 2, 4, 8, 16) if d < n} | {n} if n else set()
    return sorted({_bucket(d, shape_stable, cap) for d in out})


def choose(k: int, rows: Sequence, proposals: Sequence, policy, calibration: Calibration, cap: int,
           shape_stable: bool = False, reach: Optional[Reach] = None,
           ledger: Optional[Ledger] = None) -> CyclePlan:
    """The plan of one cycle (see the module docstring); proposals[b]: row b's suffix_index.Draft;
    reach: the rows' streaks (whether a row's last suffix draft was kept whole) and runs; ledger:
    the requests' rates so far (fairness.Ledger)."""
    proposals = [p if p.match_len >= MIN_MATCH else p._replace(tokens=[], probs=[]) for p in proposals]
    if not any(p.tokens for p in proposals):
        return head_only(k)
    classes = acceptance_classes(rows)
    e_head = _head_tokens(policy, classes)
    reach = reach or Reach()
    keys = [(kind_of(c), reach.whole.get(r.req.id, False)) for c, r in zip(classes, rows)]
    f = [max(calibration.factor(key), run_chance(reach.evidence(r.req.id, p.match_len)))
         for key, r, p in zip(keys, rows, proposals)]
    depths = _depths(k, proposals, cap, shape_stable)
    costs, step = _costs(policy, len(rows), classes, depths, k, len(e_head) - 1)
    best: Optional[tuple] = None
    own = e_head[k] / costs[k]  # a head row's tokens per unit of cost in the policy's own cycle
    for K in depths:
        per_row = [expected(p.probs, f[b], K) for b, p in enumerate(proposals)]
        for j, extra in _head_depths(k, K, len(e_head) - 1):
            cost = costs[K] + extra * step
            if not fair(e_head[j], cost, own, [r for r, e in zip(rows, per_row) if e <= e_head[j]], ledger):
                continue  # the rows left to the head would wait too long on the others' verify
            rate = sum(max(e_head[j], e) for e in per_row) / cost
            rate /= 1.0 if (K, j) == (k, k) else 1.0 + MARGIN
            if best is None or rate > best[0]:
                best = (rate, K, j, [e > e_head[j] for e in per_row], cost)
    _, K, j, suffix_rows, cost = best
    if not any(suffix_rows):
        return replace(head_only(k), cost=cost)
    head_depth = j if not all(suffix_rows) else 0
    ids = [r.req.id for r in rows]
    probs = {i: list(p.probs[:K]) for i, p, use in zip(ids, proposals, suffix_rows) if use}
    return CyclePlan(K, head_depth, probs, {i: key for i, key in zip(ids, keys) if i in probs}, cost)


def _head_depths(k: int, K: int, deepest: int) -> List[tuple]:
    """(head depth j, head steps beyond what c(K) prices) for a cycle of depth K: the policy's
    min(k, K), and the head's deepest depth the verify covers. A cycle of depth K <= `deepest`
    is priced as the head's own cycle of depth K, its K head steps included; past that, each
    step beyond min(k, K) is extra; and where the head would not have run (k = 0), one more:
    it first catches up on the inputs plain decoding left it."""
    base, top = min(k, K), min(K, deepest)
    if top <= base:
        return [(base, 0)]
    return [(base, 0), (top, (top - base if K > deepest else 0) + (base == 0))]


def _head_tokens(policy, classes: List[Hashable]) -> List[float]:
    """E_h(j) for j = 0..the head's deepest depth: the policy's estimates, else each draft
    kept with PRIOR_ACCEPT up to limits.MAX_DRAFT_DEPTH."""
    e = policy.expected_tokens(classes=classes)
    if e:
        return list(e)
    return [1.0 + sum(PRIOR_ACCEPT ** i for i in range(1, j + 1)) for j in range(MAX_DRAFT_DEPTH + 1)]
