"""What each decode cycle cost: told to the depth policy, and added to the rows' stats.

A cycle's cost for the depth policy is the interval between two finishes of the same
kind (synchronous or pipelined, plain or drafting) at the same batch size: it includes
all host work between cycles, alike for every kind. A cycle after anything else is not
timed: the first after a prefill, after an early read of a pipelined cycle (a drain),
or after a switch of kind (when a k = 0 stretch ends the head catches up on its pending
inputs; when drafting ends the first plain cycle is not overlapped). What that first
drafting cycle after plain decoding costs is reported apart, as the price of a switch.
"""

from __future__ import annotations

import time
from typing import List, Optional

from .state import acceptance_classes


class CycleClock:
    def __init__(self):
        self.last_finish = 0.0
        # (kind, batch size, drafting) of the previous finish while the next finish can be timed as
        # the interval between the two; None after anything that is not a decode cycle.
        self.mode: Optional[tuple] = None
        self.draft_time = 0.0  # drafting alone, measured when the engine profiles
        # The cycle being launched is the first drafting one after plain decoding: the
        # policy weighs what it costs beyond a steady cycle of its depth against what a
        # probe can teach.
        self.switched = False

    def skip(self, seconds: float) -> None:
        """Leave time the caller spent on other work out of the next cycle's cost."""
        self.last_finish += seconds

    def untimed(self) -> None:
        """The next cycle follows something that is not a decode cycle: do not time it."""
        self.mode = None

    def finish(self, rec, policy, kept: List[int], chances: Optional[List[List[float]]] = None) -> None:
        """A cycle `rec` (cycle.Cycle) was read: report it to the policy (with its drafts'
        keep chances, cycle.keep_chances), bill its rows."""
        rows, B = rec.rows, len(rec.rows)
        now = time.perf_counter()
        dt = now - max(rec.t0, self.last_finish)
        # Plain and drafting cycles are kinds apart even where both are synchronous (a row's
        # logits processor needs its tokens on the host) or both pipelined (`pipeline_drafts`).
        mode = ("sync" if rec.synchronous else "async", B, rec.k > 0)
        interval = now - self.last_finish
        # The depth policy learns the head's acceptance and cycle costs. A cycle with suffix
        # drafts (proposers/hybrid.py) teaches it its cost: what a verify of its depth costs
        # at this batch, which prices the next suffix drafts (hybrid_plan); and the head's
        # acceptance, only from its rows that drafted with the head (_teach_head_rows). It is
        # synchronous, timed from its launch, so its cost is known after plain decoding too
        # (where a long verify of several rows can cost far more than a line through the
        # head's depths says), unless its head rows first caught up on a plain stretch's
        # inputs: that excess is the switch's, not the verify's (read as a verify's, it priced
        # drafting too dear at a new batch size, BENCHMARKS.md). The cycle after it is not timed:
        # the head first catches up on the inputs the suffix cycle left it, alike at every depth.
        suffix = any(source == "suffix" for source, _ in rec.drafted)
        caught_up = self.switched and any(source == "mtp" and n > 0 for source, n in rec.drafted)
        classes = acceptance_classes(rows)
        if suffix:
            policy.update(rec.k, B, dt if rec.synchronous and not caught_up else None, kept, classes, head=False)
            _teach_head_rows(rec, policy, classes, kept, chances)
        else:
            policy.update(rec.k, B, interval if self.mode == mode else None, kept, classes,
                          switch_seconds=interval if self.switched else None, requests=[r.req.id for r in rows],
                          chances=chances)
        self.switched = False
        self.mode = None if suffix else mode
        self.last_finish = now
        device = (rec.computed - rec.built) if rec.computed else 0.0
        for row in rows:
            row.stats.decode_seconds += dt
            row.stats.device_seconds += device
            row.stats.overhead_seconds += dt - device - self.draft_time
            row.stats.draft_seconds += self.draft_time
        self.draft_time = 0.0


def _teach_head_rows(rec, policy, classes: List, kept: List[int], chances: Optional[List[List[float]]]) -> None:
    """The rows of a suffix cycle that drafted with the head (`classes`: every row's acceptance
    class) teach the policy its acceptance at that depth (Policy.learn_head_rows); their drafts
    past it were padding, not the head's."""
    rows = [b for b, (source, n) in enumerate(rec.drafted) if source == "mtp" and n > 0]
    if not rows:
        return
    j = rec.drafted[rows[0]][1]
    policy.learn_head_rows(j, [min(kept[b], j) for b in rows], [classes[b] for b in rows],
                           [rec.rows[b].req.id for b in rows], [chances[b][:j] for b in rows] if chances is not None else None)
