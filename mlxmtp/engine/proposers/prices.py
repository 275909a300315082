"""What a hybrid cycle costs, in plain cycles of its batch (hybrid_plan.choose prices by it).

A cycle of depth K costs c(K), the depth policy's price: the head's depth k as the policy
prices it (its choice already allowed for the doubt), any other cautiously (`relative_costs`
with its doubt); `DEFAULT_SLOPE` per draft where nothing is measured. All prices come from one
call to the policy a plan: across machines each call is a collective
(distributed/shared_policy.py).

Where the rows carry different numbers of real tokens (copying rows a long suffix draft, the
rest a few of the head's drafts) the verify may pack them (mlxlm/packing.py): where the prices
say a verify's tokens cost their compute, by `PACK_GAIN` at least between c(K) and the price of
a verify without padding that packing would leave (packing.equivalent_depth; on the line
between the nearest depths priced, so that packing asks the policy nothing more). The cycle is
still priced c(K): how much packing saves differs by machine (a verify whose cost grows with
its length, not its tokens, keeps it all), and a packed cycle's measured cost teaches c(K) at
its batch what such cycles cost there (timing.py).
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Sequence, Tuple

from ...mlxlm import packing

# The relative cost of each draft in a cycle where the policy has measured none: c(K) =
# 1 + DEFAULT_SLOPE * K. Pessimistic for GPUs (a verify of a few tokens costs about one),
# about right for CPUs, where the suffix must then be sure of long drafts to be chosen.
DEFAULT_SLOPE = 0.5
# A verify is packed only where that saves this much of a plain cycle by the prices: packing
# adds a few gathers a layer, which cost more than they save where a verify costs about what
# reading the weights costs whatever its tokens (a GPU with a batch of few tokens: the prices
# of all depths alike); where each token costs its compute (a CPU, an Apple GPU verifying
# tens of tokens of a large model) it saves most of the padding's cost.
PACK_GAIN = 0.1


class Prices:
    """c(K) for the plan's depths, the price of a head step, and whether a verify is packed."""

    def __init__(self, policy, batch_size: int, classes: List[Hashable], depths: Sequence[int], k: int,
                 deepest: int):
        known = policy.relative_costs(batch_size, classes, sorted({*depths, 1, max(deepest, 1)})) or {}
        doubted = policy.relative_costs(batch_size, classes, depths, cautious=True) or {}
        self.costs: Dict[int, float] = {0: 1.0}
        for K in depths:
            self.costs[K] = (known if K == k else doubted).get(K) or 1.0 + DEFAULT_SLOPE * K
        # A head step is priced by the slope of the head's own cycles of depths 1..`deepest` (a
        # draft more adds a step and a verified token: an upper bound of the step's cost).
        self.step = DEFAULT_SLOPE
        if deepest > 1 and known.get(1) and known.get(deepest):
            self.step = max(0.0, (known[deepest] - known[1]) / (deepest - 1))

    def verify(self, K: int, lengths: Sequence[int]) -> Tuple[float, bool]:
        """(c of a cycle of depth K whose rows carry `lengths` real tokens (1 + their drafts),
        whether its verify is packed)."""
        d = packing.equivalent_depth(lengths, K)
        return self.costs[K], d is not None and self.costs[K] - self._between(d) >= PACK_GAIN

    def _between(self, d: float) -> float:
        """c at depth d on the line between the two nearest depths priced (plain decoding: 1)."""
        below = max(K for K in self.costs if K <= d)
        above = min((K for K in self.costs if K >= d), default=below)
        if above == below:
            return self.costs[below]
        return self.costs[below] + (self.costs[above] - self.costs[below]) * (d - below) / (above - below)
