"""How likely each draft is to be kept, learnt from the cycles the engine reports.

Acceptance is counted per class of request (greedy, sampled), per depth and per
position, and estimated in three levels, each shrunk towards the one above it: all counts
(position 1 towards a prior, each deeper position towards the one before it), the
class's, and the class's at one depth; a request's first position has a fourth level, its
own first drafts (requests.py: requests of one class differ).

The class matters because the same head on the same text keeps far fewer deep drafts
under argmax agreement (greedy) than under rejection sampling. The depth matters because
acceptance is not independent from one position to the next (hard tokens come in runs
and patterns) and each depth starts its cycles at other positions (after what the cycle
before kept): on one text the first draft can be kept far more often at k = 2 than at
k = 1. On varied text the depth level mostly adds noise, which its shrinkage keeps small.

Counts decay slowly, so a change of content (prose after code) is followed too.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

from .base import Opening
from .requests import RequestAcceptance


def shrunk(kept: float, tried: float, toward: float, weight: float, optimistic: bool = False) -> float:
    """kept / tried shrunk towards `toward` by `weight` pseudo-counts; `optimistic` adds one
    standard error (what it could still turn out to be, given how little was tried)."""
    n = tried + weight
    a = (kept + toward * weight) / n
    return min(1.0, a + math.sqrt(a * (1 - a) / n)) if optimistic else a


class Acceptance:
    def __init__(self, max_depth: int, prior_accept: float, prior_weight: float,
                 depth_weight: float, decay: float, request_weight: float = 4.0):
        self.max_depth = max_depth
        self.prior_accept = prior_accept  # acceptance assumed before any draft was tried
        self.prior_weight = prior_weight  # pseudo-counts of that prior
        self.depth_weight = depth_weight  # pseudo-counts shrinking a depth's level to its class's
        self.decay = decay  # per-update forgetting of every count
        # Per (class, depth) and position (index 0 unused): drafts kept / drafts tried.
        self.kept: Dict[Tuple[Hashable, int], List[float]] = {}
        self.tried: Dict[Tuple[Hashable, int], List[float]] = {}
        self._memo: Dict[Hashable, List[float]] = {}
        self._levels: Dict[Tuple[Hashable, int, bool], Tuple[float, List[float]]] = {}
        self._first_tried: Counter = Counter()  # per class, every first draft tried
        self.request_weight = request_weight  # pseudo-counts shrinking a request's first position to its class's
        self.requests = RequestAcceptance()  # each request's own first drafts

    def estimate(self, cls: Hashable, k: int, optimistic: bool = False, request: Hashable = None) -> List[float]:
        """Estimated acceptance of positions 1..k in cycles of depth k for rows of class
        `cls` (of `request`, where it started here: its first position is partly its own);
        `optimistic` adds one standard error (what a position could still turn out to be,
        given how little it has been tried)."""
        at_depth, levels = self._depth_level(cls, k, optimistic)
        own = self.requests.first_drafts(request)
        return [self._first_position(own, at_depth, levels[0], optimistic), *levels[1:]]

    def expected_tokens(self, optimistic: bool = False, classes: Sequence[Hashable] = (None,),
                        requests: Optional[Sequence[Hashable]] = None) -> List[float]:
        """E(k) per row for k = 0..max_depth, averaged over the rows (of these classes and
        requests): one token plus, per position, the chance that it and every draft before
        it are kept."""
        rows = Counter(zip(classes, requests or [None] * len(classes)))
        total = [0.0] * (self.max_depth + 1)
        for (cls, request), n in rows.items():
            total[0] += n
            own = self.requests.first_drafts(request)
            for k in range(1, self.max_depth + 1):
                at_depth, levels = self._depth_level(cls, k, optimistic)
                run = self._first_position(own, at_depth, levels[0], optimistic)  # estimate()'s positions
                e = 1.0 + run
                for a in levels[1:]:
                    run *= a
                    e += run
                total[k] += n * e
        return [t / len(classes) for t in total]

    def record(self, k: int, kept_per_row: List[int], classes: Sequence[Hashable],
               requests: Optional[Sequence[Hashable]] = None, chances: Optional[List[List[float]]] = None) -> None:
        """One steady cycle of depth k > 0: the drafts each row (of the class and request at
        the same index; without requests, each class counts as one) kept, and each draft's
        chance of being kept once reached (None: the outcomes). A reached position counts
        its chance as kept: its mean is the acceptance, with less noise than the outcome."""
        self._memo.clear()
        self._levels.clear()
        # Every position forgets at the same pace, drafted this cycle or not: what was
        # learnt of a depth long unused grows uncertain again (and is re-explored when
        # that could pay), instead of a few early samples deciding for good.
        for counts in (*self.kept.values(), *self.tried.values()):
            for i in range(1, self.max_depth + 1):
                counts[i] *= self.decay
        self._first_tried.update(classes)
        chances = chances or [[float(kept > i) for i in range(k)] for kept in kept_per_row]
        self.requests.record([row[0] for row in chances], requests or classes)
        for kept, chance, cls in zip(kept_per_row, chances, classes):
            kept_c, tried_c = self._counts((cls, k))
            for i in range(1, min(kept + 1, k) + 1):  # the positions reached
                tried_c[i] += 1
                kept_c[i] += chance[i - 1]

    def first_drafts_tried(self, cls: Hashable) -> int:
        """How many first drafts rows of class `cls` have had tried, ever (not decayed)."""
        return self._first_tried[cls]

    def reopen(self, cls: Hashable, drafts: int, request: Hashable = None) -> None:
        """A request (of class `cls`) starts: its next `drafts` first drafts are its own to
        try (`fresh`), where the policy finds they could pay; past its opening if it is in one."""
        self.requests.start(cls if request is None else request, drafts, request is not None and isinstance(cls, Opening))

    def past_openings(self, classes: Sequence[Hashable], requests: Optional[Sequence[Hashable]]) -> None:
        """Rows (of these classes and requests) are decoded now: a request past its opening starts."""
        if requests:
            self.requests.past_opening([r for cls, r in zip(classes, requests) if not isinstance(cls, Opening)])

    def fresh(self, classes: Sequence[Hashable], requests: Optional[Sequence[Hashable]] = None) -> bool:
        """Whether a row has first drafts of its own still to try (`reopen`)."""
        return self.requests.fresh(requests or classes)

    def evidence(self, cls: Hashable) -> float:
        """First drafts tried by rows of class `cls` in steady cycles, over its depths (decayed)."""
        return sum(self.tried[key][1] for key in self.tried if key[0] == cls)

    def tried_at(self, cls: Hashable, k: int) -> float:
        """First drafts tried at depth k by rows of class `cls`, in steady cycles (decayed):
        how much of a depth's own estimate is its own, and not its class's."""
        return self.tried[cls, k][1] if (cls, k) in self.tried else 0.0

    def learnt(self) -> Tuple[Dict[Tuple[Hashable, int], Tuple[List[float], List[float]]], Counter]:
        """({(class, depth): (kept, tried) per position}, first drafts tried per class): what
        outlives a run (policy/saved.py); a request's own first drafts do not."""
        return {key: (self.kept[key], self.tried[key]) for key in self.kept}, Counter(self._first_tried)

    def restore(self, counts: Dict[Tuple[Hashable, int], Tuple[List[float], List[float]]], first: Counter) -> None:
        """Counts `learnt` gave in an earlier run, in place of those of these classes and depths."""
        for key, (kept, tried) in counts.items():
            self.kept[key], self.tried[key] = list(kept), list(tried)
        self._first_tried.update(first)
        self._memo.clear()
        self._levels.clear()

    def _counts(self, key):
        if key not in self.kept:
            self.kept[key], self.tried[key] = [0.0] * (self.max_depth + 1), [0.0] * (self.max_depth + 1)
        return self.kept[key], self.tried[key]

    def _sums(self, keys) -> Tuple[List[float], List[float]]:
        return ([sum(self.kept[key][i] for key in keys) for i in range(self.max_depth + 1)],
                [sum(self.tried[key][i] for key in keys) for i in range(self.max_depth + 1)])

    def _first_position(self, own: Optional[Tuple[float, float]], at_depth: float, level: float,
                        optimistic: bool) -> float:
        # A request's own first drafts (where it has tried some here) shrunk to its class's
        # at this depth; else the class's estimate at this depth, `level`.
        return level if own is None else shrunk(*own, at_depth, self.request_weight, optimistic)

    def _depth_level(self, cls: Hashable, k: int, optimistic: bool) -> Tuple[float, List[float]]:
        # (position 1's estimate at depth k, not optimistic; every position's estimate at depth
        # k): the levels above a request's own, kept until the next record(), as the policy
        # asks for them for every row of a batch (its requests differ in position 1 alone).
        key = (cls, k, optimistic)
        if key not in self._levels:
            in_cls = self._class_level(cls)
            kept, tried = self._counts((cls, k))
            self._levels[key] = (shrunk(kept[1], tried[1], in_cls[1], self.depth_weight),
                               [shrunk(kept[i], tried[i], in_cls[i], self.depth_weight, optimistic)
                                for i in range(1, k + 1)])
        return self._levels[key]

    def _class_level(self, cls: Hashable) -> List[float]:
        # The two upper levels of estimate(), per position (index 0 unused); kept until
        # the next record(), as the policy asks for every depth twice per cycle.
        if cls not in self._memo:
            all_kept, all_tried = self._sums(list(self.kept))
            cls_kept, cls_tried = self._sums([key for key in self.kept if key[0] == cls])
            out, prior, w = [0.0], self.prior_accept, self.prior_weight
            for i in range(1, self.max_depth + 1):
                prior = shrunk(all_kept[i], all_tried[i], prior, w)
                out.append(shrunk(cls_kept[i], cls_tried[i], prior, w))
            self._memo[cls] = out
        return self._memo[cls]
