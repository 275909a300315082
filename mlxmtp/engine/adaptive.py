"""Choose the draft depth k each cycle (0 = plain decoding) to maximise tokens/second.

Expected tokens from one cycle of depth k, per row, with a_i the probability that
draft i is kept given drafts 1..i-1 were:  E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j.
k* = argmax E(k) / c(k), where c(k) is the cost of a cycle of depth k (per batch size
bucket) and drafting must beat plain decoding by `margin`, so noise never buys a slower
setting. E(k) is computed with optimistic acceptance (one standard error up: a bandit's
upper confidence bound), so a depth is not written off on a few unlucky drafts.

Costs come from `cycle_costs.CycleCosts`: ratios between neighbouring cycles of two
depths, so that the machine's drifting speed cancels (see there); drafting depths never
measured are priced by a line a + b*k through those that were. Plain decoding and k = 1
are calibrated first, in alternating blocks.

Now and then an alternative depth is re-measured for `burst` cycles, alternating with
the regime's (between drafting depths; a switch to or from plain decoding costs a cycle
the engine does not time), so the choice follows changing costs and acceptance; probes
are spaced to cost at most `explore` (1%) of the throughput by the current estimates.
Acceptance counts decay slowly, so a change of content (prose after code) is followed too.

On a backend where verifying k+1 tokens costs (k+1)x one token (this CPU's quantized
kernels), E(k)/c(k) < 1/c(0) for every k > 0 and the policy settles on 0: as fast as MTP
off, up to the probe cycles.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

from .cycle_costs import CycleCosts


def _bucket(batch_size: int) -> int:
    b = 1
    while b < batch_size:
        b *= 2
    return b


class DepthPolicy:
    def __init__(self, max_depth: int = 4, fixed: Optional[int] = None, explore: float = 0.01,
                 min_probe_every: int = 20, max_probe_every: int = 2000, window: int = 9, margin: float = 0.05, min_samples: int = 3, burst: int = 3,
                 prior_accept: float = 0.5, prior_weight: float = 2.0, decay: float = 0.998):
        self.max_depth = max_depth if fixed is None else fixed
        self.fixed = fixed
        self.explore = explore
        self.min_probe_every = min_probe_every
        self.max_probe_every = max_probe_every
        self.window = window
        self.margin = margin
        self.min_samples = min_samples
        self.burst = burst
        self.decay = decay
        # Per position: kept / drafted. A weak prior pulls position 1 towards prior_accept
        # and each deeper position towards the estimate of the one before it (conditional
        # acceptance changes slowly with depth), so unexplored depths are neither written
        # off nor oversold.
        self.prior_accept = prior_accept
        self.prior_weight = prior_weight
        self.kept = [0.0] * (self.max_depth + 1)
        self.tried = [0.0] * (self.max_depth + 1)
        self.costs: Dict[int, CycleCosts] = {}  # per batch-size bucket
        self.cycles = 0
        self.regime = 0  # the depth chosen outside probes
        self._calibration: Dict[int, int] = {}  # bucket -> calibration cycles so far
        self._probe: Optional[int] = None
        self._probe_left = 0
        self._probe_gap = False  # the next cycle of a probe burst is a regime cycle
        self._last_probe = 0

    def acceptance(self, optimistic: bool = False) -> List[float]:
        """Estimated acceptance per position; `optimistic` adds one standard error (what
        a position could still turn out to be, given how little it has been tried)."""
        out, prior = [], self.prior_accept
        for i in range(1, self.max_depth + 1):
            n = self.tried[i] + self.prior_weight
            a = (self.kept[i] + prior * self.prior_weight) / n
            prior = a
            out.append(min(1.0, a + math.sqrt(a * (1 - a) / n)) if optimistic else a)
        return out

    def expected_tokens(self, k: int, optimistic: bool = False) -> float:
        total, run = 1.0, 1.0
        for a in self.acceptance(optimistic)[:k]:
            run *= a
            total += run
        return total

    def _costs(self, bucket: int) -> CycleCosts:
        if bucket not in self.costs:
            self.costs[bucket] = CycleCosts(window=self.window)
        return self.costs[bucket]

    def _calibrated(self, bucket: int, k: int) -> bool:
        return self._costs(bucket).samples(k) >= self.min_samples

    def choose(self, batch_size: int, limit: Optional[int] = None) -> int:
        cap = self.max_depth if limit is None else max(0, min(self.max_depth, limit))
        if self.fixed is not None:
            return min(self.fixed, cap)
        if cap == 0:
            return 0
        self.cycles += 1
        bucket = _bucket(batch_size)
        if self._probe_left > 0 and self._probe <= cap:
            if self._probe_gap and self.regime <= cap:
                self._probe_gap = False
                return self.regime
            self._probe_left -= 1
            self._probe_gap = self._probe > 0 and self.regime > 0
            return self._probe
        if not (self._calibrated(bucket, 0) and self._calibrated(bucket, 1)):
            # The two anchors first, in alternating blocks (each switch yields one ratio).
            n = self._calibration.get(bucket, 0)
            self._calibration[bucket] = n + 1
            return (n // self.burst) % 2
        table = self._costs(bucket)
        costs = table.costs(range(cap + 1))  # one fit per cycle
        # The regime is chosen by what each depth could still be (optimistic acceptance, an
        # upper confidence bound): a depth whose deeper positions were tried a few times, in
        # a bad stretch, is otherwise written off for good (only its own cycles measure
        # them). Chosen, it is measured every cycle and its bound tightens within a few
        # cycles if it was not that good. Where verifying costs ~(k+1) steps (this CPU's
        # quantized kernels), even acceptance 1.0 does not pay and the bound changes nothing.
        rates = {k: self.expected_tokens(k, optimistic=True) / c for k, c in costs.items() if c is not None}
        rates[0] *= 1 + self.margin
        best = max(rates, key=rates.get)
        if not self._calibrated(bucket, best):
            return self._start_probe(best)
        # Stay put unless clearly better: switching has costs of its own (the head catches up
        # on the inputs of a k = 0 stretch; the first plain cycle after drafting is not pipelined).
        cur = self.regime
        if cur in rates and self._calibrated(bucket, cur) and rates[best] < rates[cur] * (1 + self.margin):
            best = cur
        self.regime = best
        # Probes re-measure costs: a change in costs (or an unlucky measurement) is noticed.
        others = {k: r for k, r in rates.items() if k != best}
        if others:
            # The least recently measured of the depths within 25% of the best (else the
            # most promising one). Probes are spaced so that they cost at most `explore` of
            # the throughput: close calls often, clearly worse depths rarely.
            near = [k for k, r in others.items() if r > 0.75 * rates[best]] or [max(others, key=others.get)]
            alt = min(near, key=lambda k: table.measured_at.get(k, -1))
            # tokens a probe forgoes, relative to what the regime makes in one cycle
            # (with the mean estimate: optimism picks what to probe, not how often)
            mean = {d: self.expected_tokens(d) / costs[d] for d in (alt, best)}
            loss = self.burst * costs[alt] / costs[best] * max(0.0, 1.0 - mean[alt] / mean[best])
            every = int(min(self.max_probe_every, max(self.min_probe_every, loss / self.explore)))
            if self.cycles - self._last_probe >= every:
                return self._start_probe(alt)
        return best

    def _start_probe(self, k: int) -> int:
        # Between drafting depths (no switch of mode) the probe's cycles alternate with the
        # regime's, so that each is timed right after a regime cycle (see cycle_costs).
        self._probe, self._probe_left, self._last_probe = k, self.burst - 1, self.cycles
        self._probe_gap = k > 0 and self.regime > 0
        return k

    def update(self, k: int, batch_size: int, seconds: Optional[float], kept_per_row: List[int]) -> None:
        """Record one cycle: its depth, wall time (None: not timed) and the drafts each row kept."""
        if k > 0:
            # Every position forgets at the same pace, drafted this cycle or not: what was
            # learnt of a depth long unused grows uncertain again (and is re-explored when
            # that could pay), instead of a few early samples deciding for good.
            for i in range(1, self.max_depth + 1):
                self.kept[i] *= self.decay
                self.tried[i] *= self.decay
            for kept in kept_per_row:
                for i in range(1, k + 1):
                    if kept >= i - 1:  # position i was reached
                        self.tried[i] += 1
                        if kept >= i:
                            self.kept[i] += 1
        if seconds is not None and seconds > 0:
            self._costs(_bucket(batch_size)).add(k, seconds, self.cycles)
