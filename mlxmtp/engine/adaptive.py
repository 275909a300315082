"""Choose the draft depth k each cycle (0 = plain decoding) to maximise tokens/second.

Expected tokens from one cycle of depth k, per row, with a_i the probability that
draft i is kept given drafts 1..i-1 were:  E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j.
k* = argmax E(k) / c(k), where c(k) is the cost of a cycle of depth k (per batch size
bucket); drafting must beat plain decoding by `margin` (a switch to or from plain
decoding has costs of its own, and noise must never buy a slower setting) and another
drafting depth must beat the current one by `hysteresis`.

Acceptance is kept per class of request (greedy, sampled): the same head on the same text
keeps far fewer deep drafts under argmax agreement than under rejection sampling (demo,
position 3: 0.49 vs 0.86), so one pooled estimate would serve neither. A class's counts
are shrunk towards the pooled counts of all classes, so a new class starts from what the
others taught. A batch's E(k) is the mean over its rows.

Costs come from `cycle_costs.CycleCosts`: ratios between neighbouring cycles of two
depths, so that the machine's drifting speed cancels (see there); drafting depths never
measured are priced by a line a + b*k through those that were. Plain decoding and k = 1
are calibrated first, in alternating blocks.

The regime is chosen by the mean estimates; now and then another depth is measured for
`burst` cycles (a probe), alternating with the regime's between drafting depths. Probes
go to what could still be better (optimistic acceptance, one standard error up: a
bandit's upper confidence bound), so a depth is not written off on a few unlucky drafts,
and are spaced to cost at most `explore` (1%) of the throughput by the mean estimates.
Acceptance counts decay slowly, so a change of content (prose after code) is followed too.

On a backend where verifying k+1 tokens costs (k+1)x one token (this CPU's quantized
kernels), E(k)/c(k) < 1/c(0) for every k > 0 and the policy settles on 0: as fast as MTP
off, up to the probe cycles.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Dict, Hashable, List, Optional, Sequence

from .cycle_costs import CycleCosts


def _bucket(batch_size: int) -> int:
    b = 1
    while b < batch_size:
        b *= 2
    return b


class DepthPolicy:
    def __init__(self, max_depth: int = 4, fixed: Optional[int] = None, explore: float = 0.01,
                 min_probe_every: int = 20, max_probe_every: int = 2000, window: int = 9, margin: float = 0.05,
                 hysteresis: float = 0.02, min_samples: int = 3, burst: int = 3,
                 prior_accept: float = 0.5, prior_weight: float = 2.0, decay: float = 0.998):
        self.max_depth = max_depth if fixed is None else fixed
        self.fixed = fixed
        self.explore = explore
        self.min_probe_every = min_probe_every
        self.max_probe_every = max_probe_every
        self.window = window
        self.margin = margin
        self.hysteresis = hysteresis
        self.min_samples = min_samples
        self.burst = burst
        self.decay = decay
        # Per class and position: kept / drafted. A weak prior pulls the pooled position 1
        # towards prior_accept and each deeper position towards the estimate of the one
        # before it (conditional acceptance changes slowly with depth); a class's estimate
        # is pulled towards the pooled one. Unexplored depths are neither written off nor oversold.
        self.prior_accept = prior_accept
        self.prior_weight = prior_weight
        self.kept: Dict[Hashable, List[float]] = {}
        self.tried: Dict[Hashable, List[float]] = {}
        self.costs: Dict[int, CycleCosts] = {}  # per batch-size bucket
        self.cycles = 0
        self.regime = 0  # the depth chosen outside probes
        self._calibration: Dict[int, int] = {}  # bucket -> calibration cycles so far
        self._probe: Optional[int] = None
        self._probe_left = 0
        self._probe_gap = False  # the next cycle of a probe burst is the partner's
        self._partner: Optional[int] = None  # the depth a probe's cycles alternate with
        self._last_probe = 0

    def _counts(self, cls: Hashable):
        if cls not in self.kept:
            self.kept[cls], self.tried[cls] = [0.0] * (self.max_depth + 1), [0.0] * (self.max_depth + 1)
        return self.kept[cls], self.tried[cls]

    def acceptance(self, cls: Hashable = None, optimistic: bool = False) -> List[float]:
        """Estimated acceptance per position (of one class; None: pooled); `optimistic`
        adds one standard error (what a position could still turn out to be, given how
        little it has been tried)."""
        pooled_kept = [sum(c[i] for c in self.kept.values()) for i in range(self.max_depth + 1)]
        pooled_tried = [sum(c[i] for c in self.tried.values()) for i in range(self.max_depth + 1)]
        kept, tried = (pooled_kept, pooled_tried) if cls is None else self._counts(cls)
        out, prior = [], self.prior_accept
        for i in range(1, self.max_depth + 1):
            pooled = (pooled_kept[i] + prior * self.prior_weight) / (pooled_tried[i] + self.prior_weight)
            prior = pooled
            n = tried[i] + self.prior_weight
            a = pooled if cls is None else (kept[i] + pooled * self.prior_weight) / n
            out.append(min(1.0, a + math.sqrt(a * (1 - a) / n)) if optimistic else a)
        return out

    def expected_tokens(self, k: int, optimistic: bool = False, classes: Sequence[Hashable] = (None,)) -> float:
        """E(k) per row, averaged over the rows' classes."""
        total = 0.0
        for cls, n in Counter(classes).items():
            run = 1.0
            total += n
            for a in self.acceptance(cls, optimistic)[:k]:
                run *= a
                total += n * run
        return total / len(classes)

    def _costs(self, bucket: int) -> CycleCosts:
        if bucket not in self.costs:
            self.costs[bucket] = CycleCosts(window=self.window)
        return self.costs[bucket]

    def _calibrated(self, bucket: int, k: int) -> bool:
        return self._costs(bucket).samples(k) >= self.min_samples

    def choose(self, batch_size: int, limit: Optional[int] = None, classes: Optional[Sequence[Hashable]] = None) -> int:
        """The depth of the next cycle; `classes`: each row's acceptance class."""
        cap = self.max_depth if limit is None else max(0, min(self.max_depth, limit))
        if self.fixed is not None:
            return min(self.fixed, cap)
        if cap == 0:
            return 0
        self.cycles += 1
        bucket = _bucket(batch_size)
        if self._probe_left > 0 and self._probe <= cap:
            if self._probe_gap and self._partner <= cap:
                self._probe_gap = False
                return self._partner
            self._probe_left -= 1
            self._probe_gap = self._partner is not None
            return self._probe
        if not (self._calibrated(bucket, 0) and self._calibrated(bucket, 1)):
            # The two anchors first, in alternating blocks (each switch yields one ratio).
            n = self._calibration.get(bucket, 0)
            self._calibration[bucket] = n + 1
            return (n // self.burst) % 2
        classes = list(classes) if classes else [None]
        table = self._costs(bucket)
        costs = {k: c for k, c in table.costs(range(cap + 1)).items() if c is not None}  # one fit per cycle

        def rates(optimistic):
            r = {k: self.expected_tokens(k, optimistic, classes) / c for k, c in costs.items()}
            r[0] *= 1 + self.margin
            return r

        mean, bound = rates(False), rates(True)
        best = max(mean, key=mean.get)
        if not self._calibrated(bucket, best):
            return self._start_probe(best)
        # Stay put unless clearly better: a switch to or from plain decoding has costs of
        # its own (the head catches up on the inputs of a k = 0 stretch; the first plain
        # cycle after drafting is not pipelined), and between drafting depths a close call
        # must not flip with every noisy sample.
        cur = self.regime
        if cur in mean and self._calibrated(bucket, cur) and best != cur:
            if mean[best] < mean[cur] * (1 + (self.margin if 0 in (best, cur) else self.hysteresis)):
                best = cur
        self.regime = best
        # Probes re-measure costs and acceptance: a change in either (or an unlucky
        # measurement) is noticed. The regime is chosen by the mean estimates, but probes go
        # to what could still be better: a depth whose deeper positions were tried a few
        # times, in a bad stretch, is otherwise written off for good (only its own cycles
        # measure them). Where verifying costs ~(k+1) steps (this CPU's quantized kernels),
        # even acceptance 1.0 does not pay and no depth's bound reaches plain decoding.
        others = [k for k in costs if k != best]
        if others:
            # The least recently measured of the depths that could be better or within 25%
            # (else the most promising one). Probes are spaced so that they cost at most
            # `explore` of the throughput: close calls often, clearly worse depths rarely,
            # and a depth that could beat the regime as often as allowed.
            near = [k for k in others if bound[k] > 0.75 * mean[best]] or [max(others, key=bound.get)]
            alt = min(near, key=lambda k: table.measured_at.get(k, -1))
            if bound[alt] > mean[best]:
                every = self.min_probe_every
            else:
                # tokens a probe forgoes, relative to what the regime makes in one cycle
                loss = self.burst * costs[alt] / costs[best] * max(0.0, 1.0 - mean[alt] / mean[best])
                every = int(min(self.max_probe_every, max(self.min_probe_every, loss / self.explore)))
            if self.cycles - self._last_probe >= every:
                return self._start_probe(alt)
        return best

    def _start_probe(self, k: int) -> int:
        # Between drafting depths (no switch of mode) the probe's cycles alternate with a
        # measured partner's (the regime's, or k = 1 while the regime is plain decoding), so
        # that each is timed right after one of the partner (see cycle_costs): a burst of
        # one depth alone yields no ratio, and a depth first tried from plain decoding would
        # stay unmeasured for good.
        self._probe, self._probe_left, self._last_probe = k, self.burst - 1, self.cycles
        self._partner = self.regime if k > 0 and self.regime > 0 else (1 if k > 1 else None)
        self._probe_gap = self._partner is not None
        return k

    def update(self, k: int, batch_size: int, seconds: Optional[float], kept_per_row: List[int],
               classes: Optional[Sequence[Hashable]] = None) -> None:
        """Record one cycle: its depth, wall time (None: not timed), the drafts each row kept
        and each row's acceptance class."""
        if k > 0:
            # Every position forgets at the same pace, drafted this cycle or not: what was
            # learnt of a depth long unused grows uncertain again (and is re-explored when
            # that could pay), instead of a few early samples deciding for good.
            for counts in (*self.kept.values(), *self.tried.values()):
                for i in range(1, self.max_depth + 1):
                    counts[i] *= self.decay
            for kept, cls in zip(kept_per_row, classes or [None] * len(kept_per_row)):
                kept_c, tried_c = self._counts(cls)
                for i in range(1, k + 1):
                    if kept >= i - 1:  # position i was reached
                        tried_c[i] += 1
                        if kept >= i:
                            kept_c[i] += 1
        if seconds is not None and seconds > 0:
            self._costs(_bucket(batch_size)).add(k, seconds, self.cycles)
