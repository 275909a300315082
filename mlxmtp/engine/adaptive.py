"""Choose the draft depth k each cycle (0 = plain decoding) to maximise tokens/second.

Expected tokens from one cycle of depth k, per row, with a_i the probability that
draft i is kept given drafts 1..i-1 were:  E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j.
k* = argmax E(k) / c(k), where c(k) is the cost of a cycle of depth k (per batch size
bucket) and drafting must beat plain decoding by `margin`, so noise never buys a slower
setting. E(k) is computed with optimistic acceptance (one standard error up: a bandit's
upper confidence bound), so a depth is not written off on a few unlucky drafts. c(0) is measured; for k >= 1, c(k) = a + b*k fitted over all measured depths.

Timings on a shared machine drift (another process takes a core and every cycle gets 1.5x
slower for a while), and the chosen depth is measured far more often than the others. So
costs are kept in machine-speed-normalised units: `log_speed` follows recent cycles of
already-calibrated depths (observed / estimated, smoothed), and each sample is divided by
it before it enters its depth's window. A probe of another depth taken during a slow
stretch is then compared fairly with the regime measured during a fast one.

Now and then an alternative depth is re-measured for `burst` cycles (the engine does not
time the first cycle after a change of mode, which pays for the switch), so the choice
follows changing costs and acceptance; probes are spaced to cost at most `explore` (1%)
of the throughput by the current estimates. Acceptance counts decay
slowly, so a change of content (prose after code) is followed too.

On a backend where verifying k+1 tokens costs (k+1)x one token (this CPU's quantized
kernels), E(k)/c(k) < 1/c(0) for every k > 0 and the policy settles on 0: as fast as MTP
off, up to the probe cycles.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Deque, Dict, List, Optional


def _bucket(batch_size: int) -> int:
    b = 1
    while b < batch_size:
        b *= 2
    return b


class DepthPolicy:
    def __init__(self, max_depth: int = 4, fixed: Optional[int] = None, explore: float = 0.01,
                 min_probe_every: int = 20, max_probe_every: int = 2000, window: int = 9, margin: float = 0.05, min_samples: int = 3, burst: int = 3,
                 prior_accept: float = 0.5, prior_weight: float = 2.0, decay: float = 0.998,
                 speed_alpha: float = 0.15):
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
        self.speed_alpha = speed_alpha
        # Per position: kept / drafted. A weak prior pulls position 1 towards prior_accept
        # and each deeper position towards the estimate of the one before it (conditional
        # acceptance changes slowly with depth), so unexplored depths are neither written
        # off nor oversold.
        self.prior_accept = prior_accept
        self.prior_weight = prior_weight
        self.kept = [0.0] * (self.max_depth + 1)
        self.tried = [0.0] * (self.max_depth + 1)
        self.samples: Dict[int, Dict[int, Deque[float]]] = {}  # bucket -> k -> normalised cycle costs
        self.cost: Dict[int, Dict[int, float]] = {}  # bucket -> k -> median normalised cost
        self.log_speed = 0.0  # log(observed / normalised cost), smoothed
        self.cycles = 0
        self.regime = 0  # the depth chosen outside probes
        self.measured_at: Dict[tuple, int] = {}  # (bucket, k) -> cycle of its last timed sample
        self._probe: Optional[int] = None
        self._probe_left = 0
        self._probe_gap = False  # the next cycle of a probe burst is a regime cycle
        self._last_probe = 0
        self._regime_sample: Optional[tuple] = None  # (bucket, k, seconds, cycle) of the last timed regime cycle

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

    def _cost(self, bucket: int, k: int) -> Optional[float]:
        c = self.cost.get(bucket, {})
        if k == 0:
            return c.get(0)
        # Drafting cycles: a + b*k, fitted over every measured depth (weighted by samples).
        # Each extra draft adds one head step and one verified token, so the cost is close
        # to linear in k; pooling all depths keeps a depth measured once in a slow moment
        # from being written off for good, and prices depths never measured.
        pts = [(d, c[d], len(self.samples[bucket][d])) for d in c if d > 0]
        if not pts:
            return None
        if len({d for d, _, _ in pts}) == 1:
            d, cd, _ = pts[0]
            if 0 not in c:
                return cd
            # One depth measured: half the per-draft increment from k = 0 to it (optimistic,
            # a verify grows sublinearly in its tokens); measuring more depths corrects it.
            slope = max(cd - c[0], 1e-9) / d * 0.5
            return max(cd + (k - d) * slope, 1e-9)
        w = sum(n for _, _, n in pts)
        mk = sum(n * d for d, _, n in pts) / w
        mc = sum(n * cd for _, cd, n in pts) / w
        var = sum(n * (d - mk) ** 2 for d, _, n in pts)
        slope = max(0.0, sum(n * (d - mk) * (cd - mc) for d, cd, n in pts) / var)
        return max(mc + (k - mk) * slope, 1e-9)

    def _calibrated(self, bucket: int, k: int) -> bool:
        return len(self.samples.get(bucket, {}).get(k, ())) >= self.min_samples

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
        for k in (0, 1):  # calibrate the two anchors first (the engine skips the switch cycles)
            if not self._calibrated(bucket, k) and k <= cap:
                return k
        costs = {k: self._cost(bucket, k) for k in range(cap + 1)}  # one fit per cycle
        # The regime is chosen by what each depth could still be (optimistic acceptance, an
        # upper confidence bound): a depth whose deeper positions were tried a few times, in
        # a bad stretch, is otherwise written off for good (only its own cycles measure
        # them). Chosen, it is measured every cycle and its bound tightens within a few
        # cycles if it was not that good. Where verifying costs ~(k+1) steps (this CPU's
        # quantized kernels), even acceptance 1.0 does not pay and the bound changes nothing.
        rates = {k: self.expected_tokens(k, optimistic=True) / costs[k] for k in costs}
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
            alt = min(near, key=lambda k: self.measured_at.get((bucket, k), -1))
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
        # regime's, so that each is timed right after a regime cycle (see update).
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
        if seconds is None or seconds <= 0:
            return
        bucket = _bucket(batch_size)
        last = self._regime_sample
        if (k != self.regime and last is not None and last[:2] == (bucket, self.regime)
                and self.cycles - last[3] <= 4 and self._calibrated(bucket, self.regime)):
            # A cycle of another depth is priced against the regime cycle just before it: this
            # machine's speed jumps by up to 1.5x from one second to the next (another VM),
            # while two neighbouring cycles differ by ~7%, so the ratio of neighbours is what
            # survives the drift (the smoothed speed lags a jump by several cycles).
            sample = seconds / last[2] * self.cost[bucket][self.regime]
        else:
            if self._calibrated(bucket, k):
                # Machine speed follows every cycle of a calibrated depth; an outlier moves
                # it by at most a bounded step.
                err = math.log(seconds / (self.cost[bucket][k] * math.exp(self.log_speed)))
                self.log_speed += self.speed_alpha * max(-0.5, min(0.5, err))
            sample = seconds / math.exp(self.log_speed)
        if k == self.regime:
            self._regime_sample = (bucket, k, seconds, self.cycles)
        window = self.samples.setdefault(bucket, {}).setdefault(k, deque(maxlen=self.window))
        window.append(sample)
        self.measured_at[(bucket, k)] = self.cycles
        self.cost.setdefault(bucket, {})[k] = statistics.median(window)
