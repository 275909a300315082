"""The depth policy of a distributed engine: rank 0 decides, every rank follows.

The policy times cycles and calibrates costs, and no two machines read the same clock,
so left alone each rank would choose its own depth and the ranks' forwards would no
longer match. Here every answer that steers the engine (the depth, whether plain
decoding is the regime, whether to calibrate) is rank 0's policy's, shared in one small
collective at the point where every rank asks it; the other ranks' own policies are
only told what happened.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Sequence

from ..engine.policy import Policy
from .channel import Channel


class SharedPolicy(Policy):
    def __init__(self, inner: Policy, channel: Channel):
        self.inner = inner
        self.channel = channel
        self.max_depth = inner.max_depth

    @property
    def why(self) -> str:
        return self.inner.why if self.channel.leader else "chosen by rank 0"

    def _decided(self, value: Optional[int]) -> int:
        return self.channel.share_ints([value] if self.channel.leader else None, 1)[0]

    def choose(self, batch_size: int, limit: Optional[int] = None,
               classes: Optional[Sequence[Hashable]] = None) -> int:
        k = self.inner.choose(batch_size, limit, classes) if self.channel.leader else None
        return self._decided(k)

    def update(self, k: int, batch_size: int, seconds: Optional[float], kept_per_row: List[int],
               classes: Optional[Sequence[Hashable]] = None, switch_seconds: Optional[float] = None) -> None:
        self.inner.update(k, batch_size, seconds, kept_per_row, classes, switch_seconds)

    def plain_regime(self) -> bool:
        return bool(self._decided(int(self.inner.plain_regime()) if self.channel.leader else None))

    def needs_costs(self, batch_size: int) -> bool:
        return bool(self._decided(int(self.inner.needs_costs(batch_size)) if self.channel.leader else None))

    def seed_costs(self, batch_size: int, seconds: Dict[int, float]) -> None:
        self.inner.seed_costs(batch_size, seconds)
