"""Choose the draft depth k each cycle (0 = plain decoding) to maximise tokens/second.

Expected tokens from one cycle of depth k, per row, with a_i the probability that
draft i is kept given drafts 1..i-1 were:  E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j.
The cycle's cost c(k) is measured (wall time, median of the last `window` cycles: a
shared machine's timings have long tails) per batch size bucket; unmeasured depths are
extrapolated linearly from c(0) and c(1). k* = argmax E(k) / c(k), where drafting must
beat plain decoding by `margin` (noise must not buy a slower setting). Every
`probe_every` cycles the most promising alternative to k* is re-measured so the choice follows changing
costs and acceptance.

On a backend where verifying k+1 tokens costs (k+1)x one token (this CPU's
quantized kernels), E(k)/c(k) < 1/c(0) for every k > 0 and the policy settles on 0:
never slower than MTP off, up to the few probe cycles.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Deque, Dict, List, Optional


def _bucket(batch_size: int) -> int:
    b = 1
    while b < batch_size:
        b *= 2
    return b


class DepthPolicy:
    def __init__(self, max_depth: int = 4, fixed: Optional[int] = None, probe_every: int = 24,
                 window: int = 15, margin: float = 0.05, min_samples: int = 3, prior_accept: float = 0.5, prior_weight: float = 2.0):
        self.max_depth = max_depth if fixed is None else fixed
        self.fixed = fixed
        self.probe_every = probe_every
        self.window = window
        self.margin = margin
        self.min_samples = min_samples
        # Per position: kept / drafted. A weak prior pulls position 1 towards prior_accept
        # and each deeper position towards the estimate of the one before it (conditional
        # acceptance changes slowly with depth), so unexplored depths are neither written
        # off nor oversold.
        self.prior_accept = prior_accept
        self.prior_weight = prior_weight
        self.kept = [0.0] * (self.max_depth + 1)
        self.tried = [0.0] * (self.max_depth + 1)
        self.samples: Dict[int, Dict[int, Deque[float]]] = {}  # bucket -> k -> recent cycle seconds
        self.cost: Dict[int, Dict[int, float]] = {}  # bucket -> k -> median seconds per cycle
        self.cycles = 0
        self.last_choice = 0
        self.regime = 0  # the depth chosen outside probes

    def acceptance(self) -> List[float]:
        out, prior = [], self.prior_accept
        for i in range(1, self.max_depth + 1):
            a = (self.kept[i] + prior * self.prior_weight) / (self.tried[i] + self.prior_weight)
            out.append(a)
            prior = a
        return out

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for a in self.acceptance()[:k]:
            run *= a
            total += run
        return total

    def _cost(self, bucket: int, k: int) -> Optional[float]:
        c = self.cost.get(bucket, {})
        if k in c:
            return c[k]
        if 0 in c and 1 in c:
            # Optimistic for unmeasured depths (a verify's cost grows sublinearly in its
            # tokens): half the per-draft increment after the first; measuring corrects it.
            step = max(c[1] - c[0], 1e-9)
            return c[1] + (k - 1) * step * 0.5
        return None

    def choose(self, batch_size: int, limit: Optional[int] = None) -> int:
        cap = self.max_depth if limit is None else max(0, min(self.max_depth, limit))
        if self.fixed is not None:
            return min(self.fixed, cap)
        if cap == 0:
            return 0
        self.cycles += 1
        bucket = _bucket(batch_size)
        measured = self.cost.get(bucket, {})
        samples = self.samples.get(bucket, {})
        for k in (0, 1):  # calibrate the two anchors first, a few cycles each (warm-up outliers)
            if len(samples.get(k, ())) < self.min_samples and k <= cap:
                return k
        rates = {k: self.expected_tokens(k) / self._cost(bucket, k) for k in range(cap + 1)}
        rates[0] *= 1 + self.margin
        best = max(rates, key=rates.get)
        if best not in measured:
            return best
        # Stay put unless clearly better: switching has costs of its own (the head catches up
        # on the inputs of a k = 0 stretch; the first plain cycle after drafting is not pipelined).
        cur = self.regime
        if cur in rates and cur in measured and rates[best] < rates[cur] * (1 + self.margin):
            best = cur
        self.regime = best
        others = {k: r for k, r in rates.items() if k != best}
        if others:
            # Re-measure the most promising alternative, so a change in costs or acceptance
            # (or an unlucky measurement) is noticed; close calls are re-checked 3x as often.
            alt = max(others, key=others.get)
            every = self.probe_every // 3 if others[alt] > 0.85 * rates[best] else self.probe_every
            if self.cycles % max(every, 1) == 0:
                return alt
        return best

    def update(self, k: int, batch_size: int, seconds: float, kept_per_row: List[int]) -> None:
        """Record one cycle: its depth, wall time, and how many drafts each row kept."""
        bucket = _bucket(batch_size)
        window = self.samples.setdefault(bucket, {}).setdefault(k, deque(maxlen=self.window))
        window.append(seconds)
        self.cost.setdefault(bucket, {})[k] = statistics.median(window)
        for kept in kept_per_row:
            for i in range(1, k + 1):
                if kept >= i - 1:  # position i was reached
                    self.tried[i] += 1
                    if kept >= i:
                        self.kept[i] += 1
        self.last_choice = k
