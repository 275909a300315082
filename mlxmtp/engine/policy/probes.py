"""Probe planning for the depth policy: which other depth to measure, in which cycles, and
how often.

The regime (the depth used outside probes) is chosen by the mean estimates; now and then
another depth is run for a few cycles to re-measure its cost and acceptance, so that a
change in either (or an unlucky measurement) is noticed. Probes go to what could still be
better (optimistic acceptance, one standard error up: a bandit's upper confidence bound):
a depth whose deeper positions were tried a few times, in a bad stretch, would otherwise
be written off for good, as only its own cycles measure them. Probes are spaced so that
they cost at most a set share of the throughput by the mean estimates: close calls are
probed often, clearly worse depths rarely.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable, Dict, Hashable, List, Optional, Sequence


def plan(k: int, regime: int, burst: int, learn: int = 0, anchor: int = 1) -> List[int]:
    """The depths of a probe's cycles at depth k, the first included; `learn`: steady cycles
    of k it must have at least.

    A probe measures the cost ratio of its depth to a measured partner's and its
    acceptance in steady state. Ratios come from neighbouring cycles (see cycle_costs), so
    between drafting depths (no switch of mode) its cycles come in pairs around one of the
    partner: the regime, or the table's `anchor` (the depth its calibration blocks measured
    against plain decoding) while the regime is plain decoding (a depth first tried from
    there would otherwise stay unmeasured for good). Acceptance is counted only in a
    cycle that follows one of the same depth: a depth drafts from other positions than
    the one before it did, and on text where easy and hard tokens follow a pattern the
    first cycle says little.

    A depth's acceptance is not its class's either: on text whose hard tokens recur, whether
    they fall on drafted positions or on the verify's free token depends on k + 1 (the demo's
    repeat workload keeps 84% of first drafts at k = 3 and 58% at k = 1). A depth that could
    beat the regime and has tried few drafts of its own (DepthPolicy._worth_learning) is
    probed until it has: two steady cycles at a time, its estimate stays its class's."""
    partner = regime if k > 0 and regime > 0 else (anchor if k not in (0, anchor) else None)
    cycles = [k] * burst if partner is None else [k, k, partner, k, k]
    steady = sum(a == b == k for a, b in zip(cycles, cycles[1:]))  # those that teach acceptance
    return cycles + [k] * max(0, learn - steady)


def worth_learning(mean: Dict[int, float], bound: Dict[int, float], regime: float, classes: List[Hashable],
                   tried_at: Callable[[Hashable, int], float], learn_drafts: int) -> Dict[int, int]:
    """{depth: steady cycles it needs} for the drafting depths that could beat the regime's rate
    `regime` (by the optimistic estimates `bound`) and whose own steady cycles have tried fewer
    than `learn_drafts` first drafts (`tried_at(class, depth)`) for a class of the batch (why: plan)."""
    rows, out = Counter(classes), {}
    for k in mean:
        if k > 0 and bound[k] > regime:
            need = max((learn_drafts - tried_at(cls, k)) / n for cls, n in rows.items())
            if need > 0:
                out[k] = math.ceil(need)
    return out


def climb(best: int, priced: Dict[int, float]) -> int:
    """The depth to probe on the way to `best`: the one just above the deepest depth below it
    that ratios price (`priced`: CycleCosts.log_costs, live or calibrated), not only the line
    through measured depths; else `best`. A table with no calibration (a batch bucket reached
    later) has plain decoding and one drafting depth measured, and the line's guess for
    deeper depths is optimistic: where a verify's cost grows with its tokens (a compute-bound
    batch) a first probe at k = 4 cost several plain cycles. One depth at a time, each probe
    corrects the line before a dearer one is tried."""
    return min(best, 1 + max((k for k in priced if k < best), default=0))


def anchor(prices: Dict[int, float], expected: List[float]) -> int:
    """The drafting depth a table's calibration blocks alternate with plain decoding (1 if
    nothing better is known): the best by the `expected` tokens (E(k), k = 0..) at `prices`
    (c(k) / c(0), CycleCosts.relative, of the nearest table measured), where it beats plain
    decoding. Those prices only choose which depth to measure first; the table's own ratios
    decide. Where drafting is cheap (a large model on an Apple GPU) blocks of k = 1 learn
    little and forgo most of what k = 4 makes, and the probes that then climb to it cost
    more cycles; where plain decoding and a deep depth are a close call, that pair,
    measured directly, is what decides."""
    rates = {k: expected[k] / c for k, c in prices.items() if 0 < k < len(expected)}
    best = max(rates, key=rates.get, default=1)
    return best if rates.get(best, 0.0) > expected[0] else 1


def learning_depth(measured: List[int], bound: Dict[int, float], fresh: bool, thin: bool) -> Optional[int]:
    """The depth at which to learn acceptance (None: none): the cheapest of the `measured`
    drafting depths that could beat plain decoding by the optimistic estimates (`bound`; the
    first drafts, what decides most, cost least there). For a request's own first drafts
    (`fresh`): the one of those with the best optimistic rate, else, while its class's
    evidence is `thin`, the cheapest measured one."""
    could_pay = [k for k in measured if bound[k] > bound[0]]
    if could_pay:
        return max(could_pay, key=bound.get) if fresh else could_pay[0]
    return measured[0] if thin and measured else None


def fits(depths: List[int], limit: Optional[int]) -> bool:
    """Whether a probe of these cycles can run them all before the batch runs out of
    tokens (`limit` + 1 left to the row with the most room): a probe cut short pays its
    switch and its untimed first cycle and measures nothing (the next request runs it)."""
    return limit is None or sum(d + 1 for d in depths) <= limit + 1


def target(others: List[int], best: int, mean: Dict[int, float], bound: Dict[int, float],
           measured_at: Dict[int, int]) -> int:
    """The depth to probe: the least recently measured of those that beat the regime `best`
    by the mean estimates (the regime holds only because their costs are unsure, or
    their acceptance is stale: their own cycles settle both), else of those that could
    beat it, else of those within 25% of it, else the most promising one."""
    near = ([k for k in others if mean[k] > mean[best]] or [k for k in others if bound[k] > mean[best]]
            or [k for k in others if bound[k] > 0.75 * mean[best]] or [max(others, key=bound.get)])
    return min(near, key=lambda k: measured_at.get(k, -1))


def forgone(cycles: int, alt: int, best: int, costs: Dict[int, float], mean: Dict[int, float]) -> float:
    """Tokens that `cycles` cycles at depth `alt` forgo, relative to what the regime `best`
    makes in one cycle."""
    return cycles * costs[alt] / costs[best] * max(0.0, 1.0 - mean[alt] / mean[best])


def cannot_pay(measured: List[int], costs: Dict[int, float], plain_rate: float,
               doubt: Optional[Dict[int, float]] = None, started: Sequence[int] = (), at_least: int = 1) -> bool:
    """Whether even drafts that are always kept would not beat plain decoding at any of
    the `measured` drafting depths (k+1 tokens for a verify costing about k+1 steps, as
    on a backend whose verify grows linearly in its tokens), each cost lowered by its
    `doubt` where given (adaptive.DepthPolicy._doubts), nor at the depths `started` (only
    the start-up calibration measured them) at their price. Acceptance then has nothing to
    teach; only a change of the costs could, and those belong to the model and the machine.

    Only measured depths count (a line through two noisy costs, taken out to a deep k,
    could let probes through), and at least `at_least` of them: a depth's cost mixes what
    any drafting cycle costs (the head's step, a synchronous cycle where plain ones overlap)
    with what its drafts do, so where a verify of 2 tokens costs about 2 plain cycles (the
    CUDA backend's step-by-step Gated DeltaNet, a loaded CPU) k = 1 can never pay while
    k = 3 at 3 plain cycles can. Judged on k = 1 alone, probes came `max_probe_every`
    cycles apart and a good head was never tried (adaptive.DepthPolicy._due_probe asks for
    two; learning drafts only at depths measured live, after a probe)."""
    doubt = doubt or {}
    return (len({*measured, *started}) >= max(1, at_least)
            and all((k + 1) * doubt.get(k, 1.0) / costs[k] <= plain_rate for k in measured)
            and all((k + 1) / costs[k] <= plain_rate for k in started))


def above_the_line(costs: Dict[int, float], live: List[int], started: List[int], noise: float) -> List[int]:
    """The depths priced by the start-up calibration alone (`started`) whose price sits more
    than `noise` above the line through the two deepest depths measured live (plain decoding
    among them): a verify's cost grows at most linearly with its tokens, so such a price is
    more likely the calibration's noise (its first cycles of a shape also build graphs and
    compile kernels) than the depth's. Each is probed before it may rule its depth out: a
    depth that cannot pay at its price is never a probe's target, and one calibration that
    priced k = 3 and 4 at twice their cost kept the best depth untried for a whole run
    (BENCHMARKS.md, "The H100's cycle costs on this CPU's decoding")."""
    anchors = [0, *live][-2:]
    if len(anchors) < 2:
        return []
    (j, cj), (k, ck) = [(a, costs[a]) for a in anchors]
    slope = (ck - cj) / (k - j)
    return [d for d in started if costs[d] > (1 + noise) * (ck + slope * (d - k))]


def worth_rechecking(once: List[int], bound: Dict[int, float], noise: float) -> List[int]:
    """The depths of `once`, priced by a single probe (CycleCosts.measured_once), that would beat
    plain decoding by their optimistic rates (`bound`) at their price divided by 1 + 2 * `noise`
    (as far off as one probe's few ratios can be): only there can measuring again change the choice."""
    return [k for k in once if k in bound and bound[k] * (1 + 2 * noise) > bound[0]]


def spacing(loss: float, explore: float, least: int, most: int) -> int:
    """Cycles between probes that forgo `loss` (see forgone()) each, so that they cost an
    `explore` share of the throughput, within [least, most]."""
    return int(min(most, max(least, loss / explore)))
