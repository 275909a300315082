"""Each request's own first drafts, beside its class's history (acceptance.py).

Requests of one class differ: drafting at k = 2 makes 0.91x to 1.69x of mlx-lm on the
demo's six held-out prompts at T = 0.6 (BENCHMARKS.md, depth policy). A class's estimate
is a history of earlier requests, so a request on which drafting did not pay could keep
the next ones plain, where only rare probes would tell (no count changes in a plain
cycle). So a request's first position is estimated from its own first drafts shrunk to
its class's estimate by `Acceptance.request_weight` pseudo-counts (deeper positions keep
their class's acceptance given the one before): a request that has drafted nothing yet
could turn out a standard error of that many drafts better than its class, and the policy
lets it try `drafts` first drafts of its own where that could pay
(adaptive.DepthPolicy._learning).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, List, Optional, Sequence, Tuple


class RequestAcceptance:
    def __init__(self, keep: int = 4096):
        self.keep = keep  # requests remembered, the latest (those in a batch are among them)
        # Per request: [first drafts kept, first drafts tried, first drafts still its own to try].
        self._own: OrderedDict[Hashable, List[float]] = OrderedDict()
        self._opening: OrderedDict[Hashable, int] = OrderedDict()  # request -> drafts, from past its opening

    def start(self, request: Hashable, drafts: int, opening: bool = False) -> None:
        """A request starts: none of its drafts tried, `drafts` of its own to try (`fresh`). One
        whose rows are in their answers' opening (base.Opening) has them from its first cycle
        past it (`past_opening`): its own first drafts are to tell how it differs from its class
        where most of its answer is, and an opening is not like the rest (base.OPENING_TOKENS)."""
        table, entry = (self._opening, drafts) if opening else (self._own, [0.0, 0.0, float(drafts)])
        table[request] = entry
        table.move_to_end(request)
        while len(table) > self.keep:
            table.popitem(last=False)

    def past_opening(self, requests: Sequence[Hashable]) -> None:
        """Rows of these requests are past their answers' openings: those waiting start now."""
        for request in requests:
            if request in self._opening:
                self.start(request, self._opening.pop(request))

    def record(self, first_chances: List[float], requests: Sequence[Hashable]) -> None:
        """One steady drafting cycle: the chance each row's (of the request at that index)
        first draft had of being kept (acceptance.Acceptance.record)."""
        for chance, request in zip(first_chances, requests):
            own = self._own.get(request)
            if own is not None:
                own[0] += chance
                own[1] += 1
                own[2] -= 1

    def fresh(self, requests: Sequence[Hashable]) -> bool:
        """Whether a row of these requests has first drafts of its own still to try."""
        return any(self._own[r][2] > 0 for r in requests if r in self._own)

    def first_drafts(self, request: Hashable) -> Optional[Tuple[float, float]]:
        """(first drafts kept, first drafts tried) by the request; None for a request never
        started here (or None)."""
        own = self._own.get(request)
        return None if own is None else (own[0], own[1])
