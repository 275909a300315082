"""How far a hybrid cycle may slow the rows left to the head (hybrid_plan.choose).

A cycle whose depth other rows' suffix drafts set verifies that many positions of every row. A
long verify that pays by the batch's total can make the rows beside the copying ones a token per
several plain cycles, and an agent writing new code then waits longer for its answer than with
MTP off (BENCHMARKS.md, several agents on the H100's cycle costs). So such a cycle is taken only
where each row left to the head keeps `FAIR_SHARE` of its rate in the policy's own cycle, or else
where its answer so far (`Ledger`) keeps `REQUEST_SHARE` of plain decoding's rate after it. The
second lets a request that has made at least plain decoding's rate afford a few slow cycles
while the copying rows finish. Where the policy decodes plainly, the first alone refused every
long verify beside a row writing new code, so the copying rows got no suffix drafts at all
(BENCHMARKS.md, several agents on the H100's cycle costs). With `FAIR_SHARE` at half, the
copying rows' long verifies finished them first and left the rows writing new code to finish
last, later than with MTP off; at 0.8 those wait less and the batches decode faster (same
section).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

# The least share of its own rate (its tokens per unit of cost in the cycle the policy chose) a
# row left to the head keeps in one cycle ...
FAIR_SHARE = 0.8
# ... unless its answer so far, that cycle included, keeps this share of plain decoding's rate.
REQUEST_SHARE = 0.9


class Ledger:
    """Per request: its tokens when first planned, and the plans' costs since, in plain cycles
    of its batch (the relative costs hybrid_plan prices cycles by): its rate against plain
    decoding's, as the plan's own estimates see it."""

    def __init__(self):
        self.of: Dict[int, List[float]] = {}  # request id -> [tokens when first planned, cost since]

    def charge(self, rows: Sequence, cost: float) -> None:
        """A cycle priced at `cost` was planned for `rows`."""
        for row in rows:
            self.of.setdefault(row.req.id, [row.generated, 0.0])[1] += cost

    def affords(self, row, tokens: float, cost: float) -> bool:
        """Whether the row's answer keeps REQUEST_SHARE of plain decoding's rate after a cycle
        costing `cost` that yields it `tokens`; never for a row not planned for yet."""
        start, spent = self.of.get(row.req.id, (row.generated, 0.0))
        return spent > 0 and (row.generated - start + tokens) / (spent + cost) >= REQUEST_SHARE


def fair(tokens: float, cost: float, own: float, head_rows: Sequence, ledger: Optional[Ledger]) -> bool:
    """Whether a cycle costing `cost`, in which each of `head_rows` (the rows left to the head)
    makes `tokens`, leaves them enough: FAIR_SHARE of `own` (their rate in the policy's own
    cycle) in it, or every one's answer at REQUEST_SHARE of plain decoding's rate (`ledger`)."""
    if not head_rows or tokens / cost >= FAIR_SHARE * own:
        return True
    return ledger is not None and all(ledger.affords(row, tokens, cost) for row in head_rows)
