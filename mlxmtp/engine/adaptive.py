"""Choose the draft depth k each cycle (0 = plain decoding) to maximise tokens/second.

Expected tokens from one cycle of depth k, per row, with a_i the probability that
draft i is kept given drafts 1..i-1 were:  E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j.
k* = argmax E(k) / c(k), where c(k) is the cost of a cycle of depth k (per batch size
bucket); drafting must beat plain decoding by `margin` (a switch to or from plain
decoding has costs of its own, and noise must never buy a slower setting) and another
drafting depth must beat the current one by `hysteresis`.

Acceptance is learnt per class of request (greedy, sampled) and per depth, each level
shrunk towards the one above it (see acceptance()): the same head on the same text keeps
far fewer deep drafts under argmax agreement than under rejection sampling (demo,
position 3: 0.49 vs 0.86), and a depth drafts from other positions than another one does
(demo, greedy, one 150-token text: the first draft is kept 74% of the time at k = 1, 91%
at k = 2; over the six demo prompts k = 2 and k = 3 kept 86% and 87%, so on varied text
the depth level mostly adds noise, which its shrinkage keeps small). A batch's E(k) is the
mean over its rows.

Costs come from `cycle_costs.CycleCosts`: ratios between neighbouring cycles of two
depths, so that the machine's drifting speed cancels (see there); drafting depths never
measured are priced by a line a + b*k through those that were. Plain decoding and k = 1
are calibrated first, in alternating blocks.

The regime is chosen by the mean estimates; now and then another depth is measured for a
few cycles (a probe, see _start_probe). Probes go to what could still be better
(optimistic acceptance, one standard error up: a bandit's upper confidence bound), so a
depth is not written off on a few unlucky drafts, and are spaced to cost at most
`explore` (1%) of the throughput by the mean estimates (from plain decoding, plus the
measured cost of switching to drafting). Acceptance counts decay slowly, so a change of
content (prose after code) is followed too.

On a backend where verifying k+1 tokens costs (k+1)x one token (this CPU's quantized
kernels), E(k)/c(k) < 1/c(0) for every k > 0 and the policy settles on 0: as fast as MTP
off, up to the probe cycles, which are then rare (not even perfect drafts could pay).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from dataclasses import dataclass
from typing import Deque, Dict, Hashable, List, Optional, Sequence, Tuple

from .cycle_costs import CycleCosts
from .limits import MAX_DRAFT_DEPTH
from .policy import Policy


def _bucket(batch_size: int) -> int:
    b = 1
    while b < batch_size:
        b *= 2
    return b


@dataclass
class PolicyConfig:
    """Every knob of the depth policy, in one place."""

    explore: float = 0.01  # throughput share probes may cost, by the mean estimates
    min_probe_every: int = 20  # cycles between probes, at the least ...
    max_probe_every: int = 2000  # ... and at the most
    window: int = 15  # cost ratios kept per depth pair (cycle_costs)
    margin: float = 0.05  # drafting must beat plain decoding by this much
    hysteresis: float = 0.02  # another drafting depth must beat the current one by this much
    min_samples: int = 3  # cost samples before a depth counts as measured
    burst: int = 3  # cycles per calibration block / probe without a partner
    prior_accept: float = 0.5  # acceptance assumed before any draft was tried
    prior_weight: float = 2.0  # pseudo-counts of that prior
    depth_weight: float = 10.0  # pseudo-counts shrinking a depth's acceptance to its class's
    decay: float = 0.998  # per-cycle forgetting of acceptance counts
    calibrate: bool = True  # measure cycle costs before the first cycle of a batch bucket


# Why a cycle got its depth (DepthPolicy.why, the engine's stats and /metrics).
FIXED, NO_ROOM, CALIBRATING, PROBE, BEST, HOLDING = (
    "fixed", "no room to draft", "calibrating", "probe", "best expected rate", "holding (switch not worth it)")


class DepthPolicy(Policy):
    def __init__(self, max_depth: int = MAX_DRAFT_DEPTH, fixed: Optional[int] = None,
                 config: Optional[PolicyConfig] = None):
        self.max_depth = max_depth if fixed is None else fixed
        self.fixed = fixed
        self.cfg = config or PolicyConfig()
        self.why = ""  # the reason for the last choice (one of the constants above)
        # Per (class, depth) and position: drafts kept / drafts tried (see acceptance()).
        self.kept: Dict[Tuple[Hashable, int], List[float]] = {}
        self.tried: Dict[Tuple[Hashable, int], List[float]] = {}
        self._memo: Dict[Hashable, List[float]] = {}
        self.costs: Dict[int, CycleCosts] = {}  # per batch-size bucket
        self.cycles = 0
        self.regime = 0  # the depth chosen outside probes
        self._calibration: Dict[int, int] = {}  # bucket -> calibration cycles so far
        self._plan: List[int] = []  # the depths of a probe's cycles still to come
        self._last_probe = 0
        self._last_k: Optional[int] = None  # the depth of the previous cycle
        # What a switch from plain decoding to drafting costs beyond the cycles themselves, in
        # plain cycles, per batch-size bucket (samples: see update()).
        self.switch_costs: Dict[int, Deque[float]] = {}
        self._switch: Optional[Tuple[int, int, float]] = None  # (depth, bucket, seconds) of a switch cycle
        self._seeded: set = set()  # batch buckets whose costs were calibrated (seed_costs)

    def needs_costs(self, batch_size: int) -> bool:
        """Whether the engine should calibrate cycle costs (engine/calibration.py) before
        this cycle: an adaptive policy, and a batch bucket with no cost measured yet."""
        bucket = _bucket(batch_size)
        return (self.fixed is None and self.cfg.calibrate and self.max_depth > 0
                and bucket not in self._seeded and not self._calibrated(bucket, 0))

    def seed_costs(self, batch_size: int, seconds: Dict[int, float]) -> None:
        """Calibrated seconds per cycle of each depth at this batch size, as prior samples
        (`min_samples` each: the depths count as measured at once, and the policy skips its
        calibration blocks); the cycles timed from now on join and outweigh them."""
        bucket = _bucket(batch_size)
        self._costs(bucket).seed(seconds, self.cfg.min_samples)
        self._seeded.add(bucket)

    def _counts(self, key):
        if key not in self.kept:
            self.kept[key], self.tried[key] = [0.0] * (self.max_depth + 1), [0.0] * (self.max_depth + 1)
        return self.kept[key], self.tried[key]

    def _sums(self, keys) -> Tuple[List[float], List[float]]:
        return ([sum(self.kept[key][i] for key in keys) for i in range(self.max_depth + 1)],
                [sum(self.tried[key][i] for key in keys) for i in range(self.max_depth + 1)])

    def acceptance(self, cls: Hashable, k: int, optimistic: bool = False) -> List[float]:
        """Estimated acceptance of positions 1..k in cycles of depth k for rows of class
        `cls`; `optimistic` adds one standard error (what a position could still turn out
        to be, given how little it has been tried).

        Three levels, each shrunk towards the one above: all counts (position 1 towards
        prior_accept, each deeper position towards the one before it), the class's, and
        the class's at depth k. Depth matters because acceptance is not independent from
        one position to the next (hard tokens come in runs and patterns) and each depth
        starts its cycles at other positions (after what the cycle before kept). On one
        150-token demo text, the first draft is kept 74% of the time at k = 1 and 91% at
        k = 2, the drafts being identical where both depths draft at the same position
        (88.6% there); one estimate for both kept the policy at k = 1 for most of a
        benchmark run on that text (1.20x mlx-lm; k = 2 made 1.40x). Over the six demo
        prompts the gap is gone (k = 2: 86%, k = 3: 87%): such patterns belong to a text.
        """
        in_cls = self._class_level(cls)
        kept, tried = self._counts((cls, k))
        out = []
        for i in range(1, k + 1):
            n = tried[i] + self.cfg.depth_weight
            a = (kept[i] + in_cls[i] * self.cfg.depth_weight) / n
            out.append(min(1.0, a + math.sqrt(a * (1 - a) / n)) if optimistic else a)
        return out

    def _class_level(self, cls: Hashable) -> List[float]:
        # The two upper levels of acceptance(), per position (index 0 unused); kept until
        # the next update, as choose() asks for every depth twice.
        if cls not in self._memo:
            all_kept, all_tried = self._sums(list(self.kept))
            cls_kept, cls_tried = self._sums([key for key in self.kept if key[0] == cls])
            out, prior, w = [0.0], self.cfg.prior_accept, self.cfg.prior_weight
            for i in range(1, self.max_depth + 1):
                prior = (all_kept[i] + prior * w) / (all_tried[i] + w)
                out.append((cls_kept[i] + prior * w) / (cls_tried[i] + w))
            self._memo[cls] = out
        return self._memo[cls]

    def expected_tokens(self, optimistic: bool = False, classes: Sequence[Hashable] = (None,)) -> List[float]:
        """E(k) per row for k = 0..max_depth, averaged over the rows' classes."""
        total = [0.0] * (self.max_depth + 1)
        for cls, n in Counter(classes).items():
            total[0] += n
            for k in range(1, self.max_depth + 1):
                run, e = 1.0, 1.0
                for a in self.acceptance(cls, k, optimistic):
                    run *= a
                    e += run
                total[k] += n * e
        return [t / len(classes) for t in total]

    def _costs(self, bucket: int) -> CycleCosts:
        if bucket not in self.costs:
            self.costs[bucket] = CycleCosts(window=self.cfg.window)
        return self.costs[bucket]

    def _calibrated(self, bucket: int, k: int) -> bool:
        return self._costs(bucket).samples(k) >= self.cfg.min_samples

    def choose(self, batch_size: int, limit: Optional[int] = None, classes: Optional[Sequence[Hashable]] = None) -> int:
        """The depth of the next cycle; `classes`: each row's acceptance class."""
        cap = self.max_depth if limit is None else max(0, min(self.max_depth, limit))
        if self.fixed is not None:
            return self._because(FIXED, min(self.fixed, cap))
        if cap == 0:
            return self._because(NO_ROOM, 0)
        self.cycles += 1
        bucket = _bucket(batch_size)
        if self._plan and max(self._plan) <= cap:
            return self._because(PROBE, self._plan.pop(0))
        self._plan = []
        if not (self._calibrated(bucket, 0) and self._calibrated(bucket, 1)):
            # The two anchors first, in alternating blocks (each switch yields one ratio).
            n = self._calibration.get(bucket, 0)
            self._calibration[bucket] = n + 1
            return self._because(CALIBRATING, (n // self.cfg.burst) % 2)
        classes = list(classes) if classes else [None]
        table = self._costs(bucket)
        costs = {k: c for k, c in table.costs(range(cap + 1)).items() if c is not None}  # one fit per cycle

        def rates(optimistic):
            e = self.expected_tokens(optimistic, classes)
            r = {k: e[k] / c for k, c in costs.items()}
            r[0] *= 1 + self.cfg.margin
            return r

        mean, bound = rates(False), rates(True)
        best = max(mean, key=mean.get)
        if not self._calibrated(bucket, best):
            if self._fits(best, limit):
                return self._because(PROBE, self._start_probe(best))
            best = max((k for k in mean if self._calibrated(bucket, k)), key=mean.get)
        # Stay put unless clearly better: a switch to or from plain decoding has costs of
        # its own (the head catches up on the inputs of a k = 0 stretch; the first plain
        # cycle after drafting is not pipelined), and between drafting depths a close call
        # must not flip with every noisy sample.
        cur, why = self.regime, BEST
        if cur in mean and self._calibrated(bucket, cur) and best != cur:
            if mean[best] < mean[cur] * (1 + (self.cfg.margin if 0 in (best, cur) else self.cfg.hysteresis)):
                best, why = cur, HOLDING
        self.regime = best
        # Probes re-measure costs and acceptance: a change in either (or an unlucky
        # measurement) is noticed. The regime is chosen by the mean estimates, but probes go
        # to what could still be better: a depth whose deeper positions were tried a few
        # times, in a bad stretch, is otherwise written off for good (only its own cycles
        # measure them). Where verifying costs ~(k+1) steps (this CPU's quantized kernels),
        # even acceptance 1.0 does not pay and no depth's bound reaches plain decoding.
        others = [k for k in costs if k != best and self._fits(k, limit)]
        if others:
            # The least recently measured of the depths that could be better (else of those
            # within 25%, else the most promising one), spaced so that probes cost at most
            # `explore` of the throughput by the mean estimates: close calls often, clearly
            # worse depths rarely; from plain decoding the switch is paid too (on this CPU's
            # quantized kernels a probe's head catch-up alone cost ~1.5 plain steps).
            near = ([k for k in others if bound[k] > mean[best]] or [k for k in others if bound[k] > 0.75 * mean[best]]
                    or [max(others, key=bound.get)])
            alt = min(near, key=lambda k: table.measured_at.get(k, -1))
            # tokens a probe forgoes, relative to what the regime makes in one cycle
            n = self._probe_plan(alt).count(alt)
            loss = n * costs[alt] / costs[best] * max(0.0, 1.0 - mean[alt] / mean[best])
            if best == 0:
                loss += self._switch_cost(bucket)
            measured = [k for k in others if self._calibrated(bucket, k)]
            if best == 0 and measured and all((k + 1) / costs[k] <= mean[0] for k in measured):
                # Even drafts always kept would not beat plain decoding (k+1 tokens for a
                # verify costing ~(k+1) steps: this CPU's quantized kernels), so acceptance
                # has nothing to teach; only a change of the costs could, and those belong
                # to the model and the machine. A rare probe still notices one (simulated,
                # verify 1 + 1.2k steps: 56 probe cycles in 16200 instead of 197). Only
                # depths measured a few times count: a line through two noisy costs, taken
                # out to k = 4, let a probe through on the 4-bit demo (session 6).
                every = self.cfg.max_probe_every
            else:
                every = int(min(self.cfg.max_probe_every, max(self.cfg.min_probe_every, loss / self.cfg.explore)))
            if self.cycles - self._last_probe >= every:
                return self._because(PROBE, self._start_probe(alt))
        return self._because(why, best)

    def plain_regime(self) -> bool:
        """Whether the depth in use outside probes is plain decoding (the engine then keeps
        the head's pending inputs bounded instead of feeding them to the head)."""
        return self.regime == 0

    def _because(self, why: str, k: int) -> int:
        self.why = why
        return k

    def _start_probe(self, k: int) -> int:
        # A probe measures the cost ratio of its depth to a measured partner's and its
        # acceptance in steady state. Ratios come from neighbouring cycles (see
        # cycle_costs), so between drafting depths (no switch of mode) its cycles come in
        # pairs around one of the partner (the regime, or k = 1 while the regime is plain
        # decoding: a depth first tried from there would otherwise stay unmeasured for good).
        # Acceptance is counted only in a cycle that follows one of the same depth: a depth
        # drafts from different positions than the one before it did, and on text where
        # easy and hard tokens follow a pattern the first cycle says little (see update()).
        self._plan = self._probe_plan(k)[1:]
        self._last_probe = self.cycles
        return k

    def _switch_cost(self, bucket: int) -> float:
        samples = self.switch_costs.get(bucket)
        return statistics.median(samples) if samples else 0.0

    def _fits(self, k: int, limit: Optional[int]) -> bool:
        """Whether a probe of depth k can run its whole plan before the batch runs out of
        tokens (`limit` + 1 left to the row with the most room): a probe cut short pays its
        switch and its untimed first cycle and measures nothing (the next request runs it)."""
        return limit is None or sum(d + 1 for d in self._probe_plan(k)) <= limit + 1

    def _probe_plan(self, k: int) -> List[int]:
        """The depths of a probe's cycles, the first included."""
        partner = self.regime if k > 0 and self.regime > 0 else (1 if k > 1 else None)
        return [k] * self.cfg.burst if partner is None else [k, k, partner, k, k]

    def update(self, k: int, batch_size: int, seconds: Optional[float], kept_per_row: List[int],
               classes: Optional[Sequence[Hashable]] = None, switch_seconds: Optional[float] = None) -> None:
        """Record one cycle: its depth, wall time (None: not timed), the drafts each row kept,
        each row's acceptance class, and, for the first drafting cycle after plain decoding
        (not timed as a cycle), its wall time."""
        bucket = _bucket(batch_size)
        switch, self._switch = self._switch, (k, bucket, switch_seconds) if switch_seconds else None
        if switch is not None and seconds and switch[:2] == (k, bucket):
            # The switch cycle against the steady cycle of its depth right after it (a ratio
            # of neighbours, like every cost here): the excess, in plain cycles, is what the
            # head's catch-up and the lost overlap cost (0.12 plain steps per pending input
            # on this CPU's quantized kernels, next to nothing where a head step is cheap).
            c = self._costs(bucket).costs([0, k])
            if c[0] and c[k]:
                excess = max(0.0, switch[2] / seconds - 1.0) * c[k] / c[0]
                self.switch_costs.setdefault(bucket, deque(maxlen=self.cfg.window)).append(excess)
        # Acceptance is learnt from cycles that follow one of the same depth (the steady
        # state of that depth: see _start_probe).
        steady, self._last_k = k == self._last_k, k
        if k > 0 and steady:
            self._memo.clear()
            # Every position forgets at the same pace, drafted this cycle or not: what was
            # learnt of a depth long unused grows uncertain again (and is re-explored when
            # that could pay), instead of a few early samples deciding for good.
            for counts in (*self.kept.values(), *self.tried.values()):
                for i in range(1, self.max_depth + 1):
                    counts[i] *= self.cfg.decay
            for kept, cls in zip(kept_per_row, classes or [None] * len(kept_per_row)):
                kept_c, tried_c = self._counts((cls, k))
                for i in range(1, k + 1):
                    if kept >= i - 1:  # position i was reached
                        tried_c[i] += 1
                        if kept >= i:
                            kept_c[i] += 1
        if seconds is not None and seconds > 0:
            self._costs(bucket).add(k, seconds, self.cycles)
