"""Choose the draft depth k each cycle (0 = plain decoding) to maximise tokens/second.

Expected tokens from one cycle of depth k, per row, with a_i the probability that
draft i is kept given drafts 1..i-1 were:  E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j.
k* = argmax E(k) / c(k), where c(k) is the cost of a cycle of depth k (per batch size
bucket, and apart for greedy batches and batches with a sampled row: `cost_key`);
drafting must beat plain decoding by `margin` (a switch to or from plain decoding has
costs of its own, and noise must never buy a slower setting), even with its cost raised by
`caution` standard errors (`_doubts`: the best of noisy estimates is the one whose cost
came out too low), and another drafting depth must beat the current one by `hysteresis`.
A batch's E(k) is the mean over its rows.

The pieces: `acceptance.Acceptance` learns a_i per class of row (its kind, and its answer's
opening apart: base.row_class) and depth, a request's first draft also from its own
(`requests.RequestAcceptance`); `cycle_costs.CycleCosts` holds c(k) as ratios between
neighbouring cycles, so that the machine's drifting speed cancels (drafting depths never
measured are priced by a line a + b*k through those that were), and `SwitchCosts` the extra
cost of a switch from plain decoding to drafting; `probes` plans the cycles spent measuring other
depths than the chosen one. Plain decoding and an anchor depth (k = 1, or the one the nearest
table's prices favour: probes.anchor) are measured first, live, in alternating blocks; a
start-up calibration (engine/policy/calibration.py: the first batch bucket only, both
kinds) only gives priors, which a live ratio replaces. Until the head's
first drafts have been tried a few times, drafting goes on wherever it could pay
(`_learning`): plain decoding chosen on the prior acceptance alone would never learn
that the head is good. Likewise a depth's acceptance is its own (what its class's says
can be far off), so a depth that could beat the regime is probed long enough to try
`learn_drafts` drafts of its own (`probes.worth_learning`); and where deeper depths are priced
only by the line, probes climb one depth at a time (`probes.climb`).

Where verifying k+1 tokens costs about (k+1)x one token, E(k)/c(k) < 1/c(0) for every k > 0:
the policy settles on 0, probes rarely, and no request learns drafts: as fast as MTP off.
"""

from __future__ import annotations

import math
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

from ..limits import MAX_DRAFT_DEPTH
from . import probes
from .acceptance import Acceptance
from .base import GREEDY, Policy, bucket, cost_key
from .config import (
    BEST,
    CALIBRATING,
    FIXED,
    HOLDING,
    LEARNING,
    NO_ROOM,
    PROBE,
    UNSURE,
    PolicyConfig,
)
from .cycle_costs import CycleCosts, SwitchCosts, nearest_prices


class DepthPolicy(Policy):
    def __init__(self, max_depth: int = MAX_DRAFT_DEPTH, fixed: Optional[int] = None,
                 config: Optional[PolicyConfig] = None):
        self.max_depth = max_depth if fixed is None else fixed
        self.fixed = fixed
        self.cfg = cfg = config or PolicyConfig()
        self.why = ""  # the reason for the last choice (one of the constants above)
        self.accept = Acceptance(self.max_depth, cfg.prior_accept, cfg.prior_weight, cfg.depth_weight, cfg.decay,
                                 cfg.request_weight)
        self.costs: Dict[Tuple[int, str], CycleCosts] = {}  # per cost_key: batch bucket and kind
        self.switch = SwitchCosts(cfg.window)  # in plain cycles, per cost_key
        self.cycles = 0  # choices made
        # Cycles reported (`update`): what CycleCosts counts neighbours in. Not `cycles`: a pipelined
        # cycle is reported after the next one is chosen, a synchronous one before, and a cycle
        # with no room to draft is reported but not counted as a choice.
        self.reported = 0
        self.regime = 0  # the depth chosen on merit (not a probe, not learning), for the table in use (`_key`)
        self._key: Optional[Tuple[int, str]] = None  # the cost_key of the last choice
        self._regimes: Dict[Tuple[int, str], int] = {}  # the regime of every other table
        self._calibration: Dict[Tuple[int, str], int] = {}  # cost_key -> calibration cycles so far
        self.anchors: Dict[Tuple[int, str], int] = {}  # cost_key -> the depth its blocks measure (_anchor)
        self._plan: List[int] = []  # the depths of a probe's cycles still to come
        self._last_probe = 0
        self._last_k: Optional[int] = None  # the depth of the previous cycle
        self._unlearnt: Dict[int, int] = {}  # depth -> steady cycles it needs (`probes.worth_learning`)

    def needs_costs(self, batch_size: int) -> bool:
        """Whether to calibrate cycle costs (engine/policy/calibration.py) before this cycle: no cost
        measured at any batch size yet. Only that first one is (the server's, one row, at start-up):
        a calibration holds up every active row for dozens of cycles, so a batch bucket reached later
        learns its costs from its own cycles (calibration blocks, then probes), emitting tokens."""
        return (self.fixed is None and self.cfg.calibrate and self.max_depth > 0
                and not any(c.priors or c.samples(0) >= self.cfg.min_samples for c in self.costs.values()))

    def seed_costs(self, batch_size: int, seconds: Dict[int, float], kind: str = GREEDY) -> None:
        """Calibrated seconds per cycle of each depth at this batch size for batches of this kind,
        as priors (CycleCosts.seed): a start-up calibration on a busy machine can be off by half, so
        live cycles still measure plain decoding against an anchor depth (`_anchor`) in alternating
        blocks and probe the others; the calibration orders the depths and compiles their kernels."""
        self._costs((bucket(batch_size), kind)).seed(seconds)

    def acceptance(self, cls: Hashable, k: int, optimistic: bool = False) -> List[float]:
        """Estimated acceptance of positions 1..k in cycles of depth k (see Acceptance)."""
        return self.accept.estimate(cls, k, optimistic)

    def expected_tokens(self, optimistic: bool = False, classes: Sequence[Hashable] = (None,),
                        requests: Optional[Sequence[Hashable]] = None) -> List[float]:
        """E(k) per row for k = 0..max_depth, averaged over the rows (their classes and requests)."""
        return self.accept.expected_tokens(optimistic, classes, requests)

    def relative_costs(self, batch_size: int, classes: Optional[Sequence[Hashable]],
                       depths: Sequence[int], cautious: bool = False) -> Optional[Dict[int, float]]:
        key = cost_key(batch_size, classes)
        table = self._costs(key)
        doubt = self._doubts(key, {*depths, *table.log_costs()}) if cautious else None
        return table.relative(depths, doubt) or None

    def _costs(self, key: Tuple[int, str]) -> CycleCosts:
        if key not in self.costs:
            self.costs[key] = CycleCosts(window=self.cfg.window)
        return self.costs[key]

    def _calibrated(self, key: Tuple[int, str], k: int) -> bool:
        return self._costs(key).samples(k) >= self.cfg.min_samples

    def choose(self, batch_size: int, limit: Optional[int] = None, classes: Optional[Sequence[Hashable]] = None,
               requests: Optional[Sequence[Hashable]] = None) -> int:
        """The depth of the next cycle; `classes`, `requests`: each row's acceptance class and request."""
        cap = self.max_depth if limit is None else max(0, min(self.max_depth, limit))
        if self.fixed is not None:
            return self._because(FIXED, min(self.fixed, cap))
        if cap == 0:
            return self._because(NO_ROOM, 0)
        self.cycles += 1
        self.accept.past_openings(classes or [], requests)
        key = cost_key(batch_size, classes)
        if key != self._key:
            self._switch_table(key)
        if self._plan and max(self._plan) <= cap:
            return self._because(PROBE, self._plan.pop(0))
        self._plan = []
        costs = {k: c for k, c in self._costs(key).costs(range(cap + 1)).items() if c is not None}  # one fit per cycle
        classes = list(classes) if classes else [None]
        # Plain decoding and the table's anchor first, in alternating blocks (each switch yields one ratio); again
        # where no chain of measured pairs links them (two engines' neighbouring cycles can pair other depths).
        a, linked = self._anchor(key, classes, requests), self._costs(key).log_costs()
        if not (self._calibrated(key, 0) and self._calibrated(key, a)) or not {0, a} <= linked.keys():
            n = self._calibration.get(key, 0)
            self._calibration[key] = n + 1
            return self._because(CALIBRATING, min(cap, a * ((n // self.cfg.burst) % 2)))
        mean, bound = self._rates(costs, classes, requests, False), self._rates(costs, classes, requests, True)
        self._unlearnt = probes.worth_learning(mean, bound, mean.get(self.regime, max(mean.values())), classes,
                                               self.accept.tried_at, self.cfg.learn_drafts)
        best = max(mean, key=mean.get)
        if not self._calibrated(key, best):
            step = probes.climb(best, self._costs(key).log_costs())
            if probes.fits(self._probe_plan(step), limit):
                return self._because(PROBE, self._start_probe(step))
            best = max((k for k in mean if self._calibrated(key, k)), key=mean.get)
        doubt = self._doubts(key, mean)
        judged = {k: r / doubt.get(k, 1.0) for k, r in mean.items()}  # each cost raised by its doubt
        learn = self._learning(key, classes, requests, bound, costs, doubt)
        if learn is not None:  # not a choice on merit: the regime stays, and no probe starts
            return self._because(LEARNING, learn)
        best, why = self._hold(key, best, judged)
        self.regime = best
        if best > 0:  # plain decoding could beat the regime by as much as the regime's cost is unsure
            bound = {**bound, 0: mean[0] * doubt[best]}
        alt = self._due_probe(key, best, costs, mean, bound, limit)
        if alt is not None:
            return self._because(PROBE, self._start_probe(alt))
        return self._because(why, best)

    def _anchor(self, key: Tuple[int, str], classes: List[Hashable], requests: Optional[Sequence[Hashable]]) -> int:
        """The drafting depth a table's calibration blocks measure against plain decoding, chosen when
        they start (probes.anchor) by the nearest prices and what the batch's rows are expected to keep."""
        if key not in self.anchors:
            self.anchors[key] = probes.anchor(nearest_prices(self.costs, key, range(1, self.max_depth + 1)),
                                               self.expected_tokens(False, classes, requests))
        return self.anchors[key]

    def _learning(self, key: Tuple[int, str], classes: List[Hashable], requests: Optional[Sequence[Hashable]],
                  bound: Dict[int, float], costs: Dict[int, float], doubt: Dict[int, float]) -> Optional[int]:
        """The depth at which drafting goes on (None: none) whatever the mean estimates say, until the head's
        first drafts have been tried `learn_drafts` times for every class of the batch, and for a request's
        own first drafts (`request_started`): plain decoding chosen on the prior acceptance, or on a few
        unlucky drafts, teaches nothing about acceptance, and one noisy cost measurement could keep a
        good head idle for a whole run (BENCHMARKS.md, cold start). Where: probes.learning_depth. Nowhere
        where not even drafts always kept, at a cost lowered by its doubt, could pay: nothing to teach."""
        unlearnt = min(self.accept.first_drafts_tried(cls) for cls in set(classes)) < self.cfg.learn_drafts
        measured, _ = self._costs(key).measured(bound, self.cfg.min_samples)
        fresh = self.accept.fresh(classes, requests)
        if not (unlearnt or fresh) or probes.cannot_pay(measured, costs, bound[0], doubt):
            return None
        thin = fresh and any(self.accept.evidence(cls) < self.cfg.settled for cls in set(classes))
        return probes.learning_depth(measured, bound, fresh, thin)

    def learn_head_rows(self, j: int, kept_per_row: List[int], classes: Sequence[Hashable], requests=None, chances=None):
        """Policy.learn_head_rows: the head's rows beside suffix drafts would otherwise never learn it."""
        self.accept.record(j, kept_per_row, classes, requests, chances if self.cfg.keep_chances else None)

    def request_started(self, cls: Hashable, request: Hashable = None) -> None:
        """A request's first cycle: past its opening it tries `learn_drafts` first drafts of its own (`_learning`)
        where they could pay by its own optimistic estimate (requests.py), or while its class's evidence is thin."""
        self.accept.reopen(cls, self.cfg.learn_drafts, request)

    def _switch_table(self, key: Tuple[int, str]) -> None:
        """A batch priced by another table (another batch bucket or kind) than the last cycle: its own
        regime, and a probe planned against the other regime is dropped (its ratios would pair tables)."""
        if self._key is not None:
            self._regimes[self._key] = self.regime
        self._key, self.regime, self._plan = key, self._regimes.get(key, 0), []

    def _rates(self, costs: Dict[int, float], classes: List[Hashable], requests: Optional[Sequence[Hashable]],
               optimistic: bool) -> Dict[int, float]:
        # Expected tokens per unit of cost, plain decoding's raised by the margin drafting must beat.
        e = self.expected_tokens(optimistic, classes, requests)
        r = {k: e[k] / c for k, c in costs.items()}
        r[0] *= 1 + self.cfg.margin
        return r

    def _doubts(self, key: Tuple[int, str], depths) -> Dict[int, float]:
        """Per drafting depth, exp(`caution` standard errors of its cost's ratio to plain decoding)
        (CycleCosts.spread_from_plain); a depth no measured pair links to plain decoding, priced
        by the line through those that are, is no surer than the least sure of them."""
        spread = self._costs(key).spread_from_plain(self.cfg.cost_noise)
        beyond = max(spread.values()) + self.cfg.cost_noise
        return {k: math.exp(self.cfg.caution * spread.get(k, beyond)) for k in depths if k > 0}

    def _hold(self, key: Tuple[int, str], best: int, judged: Dict[int, float]):
        """(depth, reason): `best` (by the mean rates) unless its cautious rate (`judged`) does
        not beat plain decoding; and stay put unless that is clearly better. A switch to or from
        plain decoding has costs of its own (the head catches up on a k = 0 stretch's inputs;
        the first plain cycle after drafting is not pipelined), and between drafting depths a
        close call must not flip with every noisy sample."""
        cur, why = self.regime, BEST
        if best > 0 and judged[best] <= judged[0]:  # then the measured depth surest to pay, if any
            best = max((k for k in judged if k == 0 or self._calibrated(key, k)), key=judged.get)
            why = UNSURE if best == 0 else BEST
        if self.why == LEARNING:  # a depth chosen to learn acceptance was never chosen on merit
            return best, why
        if cur in judged and self._calibrated(key, cur) and best != cur:
            if judged[best] < judged[cur] * (1 + (self.cfg.margin if 0 in (best, cur) else self.cfg.hysteresis)):
                return cur, HOLDING
        return best, why

    def _due_probe(self, key: Tuple[int, str], best: int, costs: Dict[int, float], mean: Dict[int, float],
                   bound: Dict[int, float], limit: Optional[int]) -> Optional[int]:
        """The depth to probe now, if due (see probes): first a price to check (a calibrated one above the line
        through live ones; from plain decoding without calibration, one a single probe measured: CycleCosts.measured_once);
        else spaced by what it forgoes (from plain decoding, the switch too), rarest where nothing could pay."""
        others = [k for k in costs if k != best and probes.fits(self._probe_plan(k), limit)]
        if not others:
            return None
        table, since = self._costs(key), self.cycles - self._last_probe
        live, seeded = table.measured(costs, self.cfg.min_samples)
        once = table.measured_once(self.cfg.min_samples) if best == 0 and not table.priors else []
        once = probes.worth_rechecking(once, bound, self.cfg.cost_noise)
        doubtful = [k for k in probes.above_the_line(costs, live, seeded, self.cfg.cost_noise) + once if k in others]
        if doubtful and since >= self.cfg.min_probe_every:
            return min(doubtful)
        alt = probes.climb(probes.target(others, best, mean, bound, table.measured_at), table.log_costs())
        # A depth whose acceptance is mostly its class's is priced by what it could turn out to be.
        rates = {**mean, alt: bound[alt]} if alt in self._unlearnt or alt == 0 else mean
        loss = probes.forgone(self._probe_plan(alt).count(alt), alt, best, costs, rates)
        loss += self.switch.cost(key) if best == 0 else 0.0
        measured, started = [k for k in live if k in others], [k for k in seeded if k in others]
        if best == 0 and probes.cannot_pay(measured, costs, mean[0], started=started, at_least=min(2, self.max_depth)):
            every = self.cfg.max_probe_every
        else:
            every = probes.spacing(loss, self.cfg.explore, self.cfg.min_probe_every, self.cfg.max_probe_every)
        return alt if since >= every else None

    def plain_regime(self) -> bool:
        """Whether the depth in use outside probes is plain decoding (Policy.plain_regime)."""
        return self.regime == 0 and self.why != LEARNING

    def _because(self, why: str, k: int) -> int:
        self.why = why
        return k

    def _start_probe(self, k: int) -> int:
        self._plan = self._probe_plan(k)[1:]
        self._last_probe = self.cycles
        return k

    def _probe_plan(self, k: int) -> List[int]:
        return probes.plan(k, self.regime, self.cfg.burst, self._unlearnt.get(k, 0), self.anchors.get(self._key, 1))

    def update(self, k: int, batch_size: int, seconds: Optional[float], kept_per_row: List[int],
               classes: Optional[Sequence[Hashable]] = None, switch_seconds: Optional[float] = None,
               head: bool = True, requests: Optional[Sequence[Hashable]] = None,
               chances: Optional[List[List[float]]] = None) -> None:
        """Record one cycle (Policy.update); only a cycle of the head's drafts teaches acceptance."""
        key = cost_key(batch_size, classes)
        self.switch.update(k, key, seconds if head else None, switch_seconds, self._costs)
        # Acceptance is learnt from cycles that follow one of the same depth (its steady state: probes.plan).
        steady, self._last_k = k == self._last_k, k if head else None
        if k > 0 and steady and head:
            self.accept.record(k, kept_per_row, classes or [None] * len(kept_per_row), requests,
                               chances if self.cfg.keep_chances else None)
        self.reported += 1
        if seconds is not None and seconds > 0:
            self._costs(key).add(k, seconds, self.reported, head)
