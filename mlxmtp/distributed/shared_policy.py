"""The depth policy of a distributed engine: rank 0 decides, every rank follows.

The policy times cycles and calibrates costs, and no two machines read the same clock,
so left alone each rank would choose its own depth and the ranks' forwards would no
longer match. Here every answer that steers the engine (the depth, whether plain
decoding is the regime, whether to calibrate, and the estimates a cycle's suffix drafts
are planned by: proposers/hybrid_plan.py) is rank 0's policy's, shared in one small
collective at the point where every rank asks it; the other ranks' own policies are
only told what happened. A policy's `needs_costs` stays no for a batch size once it said
no (adaptive.DepthPolicy: calibrated costs are kept), so that answer is shared once.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Hashable, List, Optional, Sequence

from ..engine.policy.base import GREEDY, Policy
from .channel import Channel


class SharedPolicy(Policy):
    """`news()` (rank 0): whether requests or cancellations wait to be shared. Its answer
    travels with each depth, so the next step can skip its message when there is none
    (`quiet`): in steady decoding a cycle then costs one control collective, not three."""

    def __init__(self, inner: Policy, channel: Channel, news: Callable[[], bool] = lambda: True,
                 digest: Callable[[], int] = lambda: 0, check: Callable[[int], None] = lambda d: None):
        self.inner = inner
        self.channel = channel
        self.news = news
        self.digest, self.check = digest, check  # the engine's token digest travels with each depth
        self.max_depth = inner.max_depth
        self.quiet = False  # rank 0 said at the last depth choice that nothing new waits
        self._plain: Optional[bool] = None  # plain_regime, shared with the last depth
        self._costs_known: set = set()  # batch sizes needs_costs said no for (it stays no)

    @property
    def why(self) -> str:
        return self.inner.why if self.channel.leader else "chosen by rank 0"

    def _decided(self, values: Optional[List[int]], n: int = 1) -> List[int]:
        return self.channel.share_ints(values if self.channel.leader else None, n)

    def choose(self, batch_size: int, limit: Optional[int] = None,
               classes: Optional[Sequence[Hashable]] = None, requests: Optional[Sequence[Hashable]] = None) -> int:
        mine = None
        if self.channel.leader:
            mine = [self.inner.choose(batch_size, limit, classes, requests), int(self.inner.plain_regime()), int(self.news()),
                    self.digest()]
        k, plain, news, digest = self._decided(mine, 4)
        self.check(digest)
        self._plain, self.quiet = bool(plain), not news
        return k

    def expected_tokens(self, optimistic: bool = False, classes: Sequence[Hashable] = (None,)) -> Optional[List[float]]:
        depths = range(self.max_depth + 1)
        e = self.inner.expected_tokens(optimistic, classes) if self.channel.leader else None
        shared = self._estimates(None if e is None else dict(enumerate(e)), depths)
        return None if shared is None else [shared[k] for k in depths]

    def relative_costs(self, batch_size: int, classes: Optional[Sequence[Hashable]],
                       depths: Sequence[int], cautious: bool = False) -> Optional[Dict[int, float]]:
        return self._estimates(self.inner.relative_costs(batch_size, classes, depths, cautious)
                               if self.channel.leader else None, depths)

    def _estimates(self, mine: Optional[Dict[int, float]], keys: Sequence[int]) -> Optional[Dict[int, float]]:
        """Rank 0's estimate per key (None: it has none; a key it lacks is left out)."""
        values = None
        if self.channel.leader:
            values = [0.0] + [math.nan] * len(keys) if mine is None else [1.0, *(mine.get(k, math.nan) for k in keys)]
        known, *values = self.channel.share_floats(values, 1 + len(keys))
        return {k: v for k, v in zip(keys, values) if not math.isnan(v)} if known else None

    def update(self, k: int, batch_size: int, seconds: Optional[float], kept_per_row: List[int],
               classes: Optional[Sequence[Hashable]] = None, switch_seconds: Optional[float] = None,
               head: bool = True, requests: Optional[Sequence[Hashable]] = None,
               chances: Optional[List[List[float]]] = None) -> None:
        self.inner.update(k, batch_size, seconds, kept_per_row, classes, switch_seconds, head, requests, chances)

    def learn_head_rows(self, j: int, kept_per_row: List[int], classes: Sequence[Hashable],
                        requests: Optional[Sequence[Hashable]] = None,
                        chances: Optional[List[List[float]]] = None) -> None:
        self.inner.learn_head_rows(j, kept_per_row, classes, requests, chances)

    def request_started(self, cls: Hashable, request: Hashable = None) -> None:
        self.inner.request_started(cls, request)

    def plain_regime(self) -> bool:
        if self._plain is not None:  # shared with the depth of the cycle just chosen
            plain, self._plain = self._plain, None
            return plain
        return bool(self._decided([int(self.inner.plain_regime())] if self.channel.leader else None)[0])

    def needs_costs(self, batch_size: int) -> bool:
        if batch_size in self._costs_known:
            return False
        needed = bool(self._decided([int(self.inner.needs_costs(batch_size))] if self.channel.leader else None)[0])
        if not needed:
            self._costs_known.add(batch_size)
        return needed

    def seed_costs(self, batch_size: int, seconds: Dict[int, float], kind: str = GREEDY) -> None:
        self.inner.seed_costs(batch_size, seconds, kind)
