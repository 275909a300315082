"""Relative costs of decode cycles of each depth, measured so that the machine's drift cancels.

On a shared machine a cycle's speed can jump from one second to the next (another process
takes the core) by far more than two neighbouring cycles differ. A cost per depth in
seconds, or in units of a smoothed machine speed, drifts with those jumps; and since the
depth in use is measured far more often than the others, the drift ends up deciding.
So only ratios between neighbours are kept: a timed cycle of depth k right after one of
depth j (at most `max_gap` cycles back: the engine does not time the first cycle after a
switch between plain and drafting cycles, nor, into drafting, the last plain cycle, read
early) gives one sample of log(c_k / c_j). A cycle with suffix drafts (proposers/hybrid.py)
pairs only with a neighbour at most `suffix_gap` back, either way: paired three cycles
apart, those ratios misled the plan, and 8 rows of agents on the H100's costs decoded
plainly where drafting paid (BENCHMARKS.md). The samples of all measured pairs are
reconciled into log-costs relative to one another by least squares (a handful of depths,
solved by a few sweeps). Drafting depths that no pair reaches are priced by a straight
line a + b*k through the ones that are.

The first drafting cycle after plain decoding costs more than a steady one (the head
catches up on the inputs of the plain stretch, and that cycle is not overlapped with the
one before); `SwitchCosts` learns that excess, again from a ratio of neighbours.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Callable, Deque, Dict, Hashable, Iterable, List, Optional, Tuple

CHI2_1_MEDIAN = 0.455  # the median of a chi-square with one degree of freedom


class CycleCosts:
    def __init__(self, window: int = 9, max_gap: int = 3, suffix_gap: int = 2):
        self.window = window
        self.max_gap, self.suffix_gap = max_gap, suffix_gap
        self.pairs: Dict[Tuple[int, int], Deque[float]] = {}  # (j, k), j < k -> samples of log(c_k / c_j)
        self.priors: Dict[Tuple[int, int], float] = {}  # (j, k) -> log(c_k / c_j) from a calibration
        self.measured_at: Dict[int, int] = {}  # depth -> cycle of its last timed sample
        # Squared log-ratios of neighbouring timed cycles of one depth: the machine's noise
        # in a pair sample, seen in every steady cycle (spread_from_plain).
        self.jitter: Deque[float] = deque(maxlen=4 * window)
        # (depth, log seconds, cycle, whether the head's own) of the last timed cycle
        self._last: Optional[Tuple[int, float, int, bool]] = None
        self._solved: Optional[Dict[int, float]] = None
        # What samples() and spread_from_plain() derive, until the next sample: the policy
        # asks for them many times a cycle, and a cycle adds at most one sample.
        self._derived: Dict[Hashable, object] = {}

    def add(self, k: int, seconds: float, cycle: int, head: bool = True) -> None:
        """A timed cycle of depth k (`cycle` counts every cycle, timed or not); `head`: False for
        a cycle with suffix drafts."""
        log_s = math.log(seconds)
        last = self._last
        near = last is not None and cycle - last[2] <= (self.max_gap if head and last[3] else self.suffix_gap)
        if near:
            self._derived.clear()
        if near and last[0] == k:
            self.jitter.append((log_s - last[1]) ** 2)
        elif near:
            j, log_j = last[0], last[1]
            key, d = ((j, k), log_s - log_j) if j < k else ((k, j), log_j - log_s)
            self.pairs.setdefault(key, deque(maxlen=self.window)).append(d)
            self._solved = None
        self._last = (k, log_s, cycle, head)
        self.measured_at[k] = cycle

    def seed(self, seconds: Dict[int, float]) -> None:
        """Priors from measured `seconds` per cycle (engine/policy/calibration.py): k = 1's ratio to
        plain decoding, each deeper depth's to k = 1. A prior prices its pair only until a
        timed cycle measures that pair: one measurement at start-up on a busy machine can be
        off by half, and a live ratio is never outvoted by it. Chained this way, the live
        ratio of k = 1 to plain decoding, where measured, also moves the deeper depths."""
        for k, c in seconds.items():
            base = 0 if k == 1 else 1
            if k > 0 and seconds.get(base):
                self.priors[(base, k)] = math.log(c / seconds[base])
        self._solved = None
        self._derived.clear()

    def restore(self, pairs: Dict[Tuple[int, int], List[float]], jitter: List[float]) -> None:
        """Ratios and noise an earlier run measured (policy/saved.py), in place of any live ones."""
        self.pairs = {pair: deque(w, maxlen=self.window) for pair, w in pairs.items()}
        self.jitter = deque(jitter, maxlen=self.jitter.maxlen)
        self._solved = None
        self._derived.clear()

    def measured(self, depths: Iterable[int], min_samples: int) -> Tuple[List[int], List[int]]:
        """(the drafting depths of `depths` in `min_samples` live ratios or more, those of the
        rest a calibration priced (`seed`)): measured costs, not the line's."""
        live = [k for k in sorted(depths) if k > 0 and self.samples(k) >= min_samples]
        seeded = {k for _, k in self.priors}
        return live, [k for k in sorted(depths) if k > 0 and k not in live and k in seeded]

    def measured_once(self, min_samples: int) -> List[int]:
        """The drafting depths timed live whose price rests on a single probe (fewer than twice
        `min_samples` ratios), which a few noisy cycles can put 20% off. At a batch size with no
        calibration, decoding plainly, one probe that read k = 2 20% dear priced k = 3 and 4, by the
        line through it, out of every probe for a whole run (BENCHMARKS.md, four rows on the H100's
        costs); the policy measures such a price again where that could change its choice
        (probes.worth_rechecking)."""
        return [k for k in sorted(self.measured_at) if k > 0 and 0 < self.samples(k) < 2 * min_samples]

    def samples(self, k: int) -> int:
        """How many neighbour ratios involve depth k."""
        if ("samples", k) not in self._derived:
            self._derived["samples", k] = sum(len(w) for pair, w in self.pairs.items() if k in pair)
        return self._derived["samples", k]

    def log_costs(self) -> Dict[int, float]:
        """log c(k) up to one common constant, for the depths linked (by a chain of measured
        pairs) to plain decoding, or while it has no pair, to the most measured depth. Every
        price is relative to plain decoding's: a pair of long suffix verifies timed back to
        back, linked to nothing else, must not stand in for it, however often measured (the
        policy would then lose c(0) and measure it again, in calibration blocks). The most
        measured depth of plain decoding's group is held fixed while the rest are solved."""
        if self._solved is not None:
            return self._solved
        links: Dict[int, list] = {}
        known = {pair: (statistics.median(w), len(w)) for pair, w in self.pairs.items()}
        for (j, k), (d, n) in {**{pair: (d, 1) for pair, d in self.priors.items()}, **known}.items():
            links.setdefault(j, []).append((k, d, n))  # log c_k = log c_j + d
            links.setdefault(k, []).append((j, -d, n))
        if not links:
            self._solved = {}
            return self._solved
        group = _first_guess(links, 0) if 0 in links else links
        root = max((k for k in links if k in group), key=self.samples)
        solved = _first_guess(links, root)
        for _ in range(20):  # then least squares over every pair (Gauss-Seidel; tiny graph)
            for k in solved:
                if k != root:
                    w = sum(n for _, _, n in links[k])
                    solved[k] = sum(n * (solved[j] - d) for j, d, n in links[k]) / w
        self._solved = solved
        return solved

    def spread_from_plain(self, prior_sd: float) -> Dict[int, float]:
        """{depth: standard error of log(c_k / c_0)} for the depths linked to plain decoding.

        Each pair's median of n samples is off by about sd / sqrt(n) (a prior: n = 1), sd
        that of a pair sample: measured on neighbouring cycles of one depth, which differ by
        the machine's noise alone (robustly: the median of their squared log-ratios over
        that of a chi-square; `prior_sd` until there are 5). Along a chain of pairs the
        errors add up; a depth's spread is that of its least uncertain chain to plain
        decoding.

        Choosing the best of noisy rates favours whichever cost came out too low (the
        winner's curse): the policy drafts only where drafting pays even with its cost this
        much higher (DepthPolicy._doubts)."""
        if ("spread", prior_sd) not in self._derived:
            self._derived["spread", prior_sd] = self._spread(prior_sd)
        return dict(self._derived["spread", prior_sd])

    def _spread(self, prior_sd: float) -> Dict[int, float]:
        var = statistics.median(self.jitter) / CHI2_1_MEDIAN if len(self.jitter) >= 5 else prior_sd**2
        edges = {pair: var for pair in self.priors}
        edges.update({pair: var / len(w) for pair, w in self.pairs.items()})
        spread, changed = {0: 0.0}, True
        while changed:  # shortest chains by variance (Bellman-Ford, until a pass changes nothing)
            changed = False
            for (j, k), v in edges.items():
                for a, b in ((j, k), (k, j)):
                    if a in spread and spread[a] + v < spread.get(b, math.inf):
                        spread[b], changed = spread[a] + v, True
        return {k: math.sqrt(v) for k, v in spread.items()}

    def costs(self, depths: Iterable[int]) -> Dict[int, Optional[float]]:
        """Relative cost of a cycle of each depth (None: not known yet)."""
        known = {k: math.exp(v) for k, v in self.log_costs().items()}
        drafting = [(k, c, self.samples(k)) for k, c in known.items() if k > 0]
        out: Dict[int, Optional[float]] = {}
        for k in depths:
            if k in known:
                out[k] = known[k]
            elif k == 0 or not drafting:
                out[k] = None
            else:
                out[k] = _line(drafting, known.get(0), k)
        return out

    def relative(self, depths: Iterable[int], doubt: Optional[Dict[int, float]] = None) -> Dict[int, float]:
        """c(k) / c(0) for each of `depths` that is known ({} while plain decoding is not), never
        less for a deeper depth than for a shallower one: a verify of more tokens costs no less,
        whatever two noisy medians say. `doubt` (depth -> factor, DepthPolicy._doubts) raises
        each cost; a depth deeper than the deepest linked one then costs halfway between that
        one's cost and the line's price. The line through a few short depths, noisy, can be far
        steeper than a long verify's real cost (a verify grows sublinearly in its tokens) and
        would price it out of ever being tried, and so measured; the deepest one's cost alone
        is no price at all where each draft costs most of a plain cycle (a compute-bound batch),
        and every deeper depth would be tried at a loss of many cycles."""
        depths = list(depths)
        linked = self.log_costs()
        deepest = max(linked, default=0)
        c = self.costs([0, *linked, *depths])
        if not c.get(0):
            return {}
        out, floor = {}, 0.0
        for k in sorted({*linked, *depths}):
            if not c.get(k):
                continue
            if doubt is not None and 0 < deepest < k:
                cost = (c[deepest] + c[k]) / 2
            else:
                cost = c[k] * (doubt or {}).get(k, 1.0)
            floor = max(floor, cost)
            out[k] = floor / c[0]
        return {k: out[k] for k in depths if k in out}


class SwitchCosts:
    """What a switch from plain decoding to drafting costs beyond the cycles themselves, in
    plain cycles, per cost table (adaptive.cost_key: batch-size bucket and batch kind)."""

    def __init__(self, window: int):
        self.window = window
        self.samples: Dict[Hashable, Deque[float]] = {}
        self._pending: Optional[Tuple[int, Hashable, float]] = None  # (depth, table key, seconds) of a switch cycle

    def update(self, k: int, key: Hashable, seconds: Optional[float], switch_seconds: Optional[float],
               table: Callable[[Hashable], CycleCosts]) -> None:
        """One cycle of depth k (timed: `seconds`; the first after a switch: `switch_seconds`
        instead); `table`: the cycle costs of a table key."""
        switch, self._pending = self._pending, (k, key, switch_seconds) if switch_seconds else None
        if switch is not None and seconds and switch[:2] == (k, key):
            # The switch cycle against the steady cycle of its depth right after it: the
            # excess, in plain cycles, is what the head's catch-up and the lost overlap cost.
            c = table(key).costs([0, k])
            if c[0] and c[k]:
                excess = max(0.0, switch[2] / seconds - 1.0) * c[k] / c[0]
                self.samples.setdefault(key, deque(maxlen=self.window)).append(excess)

    def cost(self, key: Hashable) -> float:
        """The typical excess of a switch for this table key (0 until one was measured)."""
        samples = self.samples.get(key)
        return statistics.median(samples) if samples else 0.0


def nearest_prices(tables: Dict[Tuple[int, str], CycleCosts], key: Tuple[int, str],
                   depths: Iterable[int]) -> Dict[int, float]:
    """c(k) / c(0) of `depths` by the table of cost key `key` (batch bucket, kind) if it has
    prices (a start-up calibration's), else by the nearest batch bucket's table that has, of
    the same kind first ({} if none has)."""
    def distance(other: Tuple[int, str]):
        return other[1] != key[1], abs(math.log2(other[0]) - math.log2(key[0]))

    for other in sorted(tables, key=distance):
        prices = tables[other].relative(depths)
        if prices:
            return prices
    return {}


def _first_guess(links: Dict[int, list], start: int) -> Dict[int, float]:
    """log c(k) - log c(start) along a spanning tree from `start`, for the depths a chain of
    measured pairs links to it (links: depth -> [(depth, log-ratio, samples)])."""
    solved, todo = {start: 0.0}, [start]
    while todo:
        j = todo.pop()
        for k, d, _ in links[j]:
            if k not in solved:
                solved[k] = solved[j] + d
                todo.append(k)
    return solved


def _line(points, c0: Optional[float], k: int) -> float:
    """Cost of drafting depth k from the measured drafting depths: each extra draft adds
    one head step and one verified token, so the cost is close to linear in k."""
    if len({d for d, _, _ in points}) == 1:
        d, cd, _ = points[0]
        if c0 is None:
            return cd
        # One depth measured: half the per-draft increment from k = 0 to it (optimistic:
        # a verify grows sublinearly in its tokens); measuring another depth corrects it.
        return max(cd + (k - d) * max(cd - c0, 1e-9) / d * 0.5, 1e-9)
    points = [(d, c, max(n, 1)) for d, c, n in points]  # a depth priced by priors alone counts once
    w = sum(n for _, _, n in points)
    mk = sum(n * d for d, _, n in points) / w
    mc = sum(n * c for _, c, n in points) / w
    var = sum(n * (d - mk) ** 2 for d, _, n in points)
    slope = max(0.0, sum(n * (d - mk) * (c - mc) for d, c, n in points) / var)
    return max(mc + (k - mk) * slope, 1e-9)
