"""The MTP head as a `Proposer`: drafts chained by the model's own multi-token-prediction head.

The head's state is the Batch's head cache (built at prefill, joined, filtered and trimmed
with the rows, state.py) and each row's pending inputs (Row.pend, Row.pend_t: main-model
hidden states paired with the tokens after them, mtp_head.py). A cycle feeds the head its
pending inputs and chains k drafts (mtp_head.draft); after the verify the rows the head
wrote from its own guesses are trimmed and the verify's hidden states become the next
pending inputs (mtp_inputs.py), so the head always drafts from the main model's states.
"""

from __future__ import annotations

from typing import Callable, List

from ..pieces import ModelPieces
from . import mtp_inputs
from .base import Drafts, Picker, Proposer
from .mtp_head import draft, draft_unread


class MTPProposer(Proposer):
    pipelines = True  # the head drafts from a cycle's hidden states while still on the device
    source = "mtp"

    def __init__(self, pieces: ModelPieces, plain_regime: Callable[[], bool]):
        self.pieces = pieces
        # Whether the depth policy's regime is plain decoding now: after a plain cycle the
        # pending inputs are then dropped, else absorbed (mtp_inputs.keep_bounded).
        self.plain_regime = plain_regime

    def propose(self, batch, rows: List, k: int, pick: Picker) -> Drafts:
        p = self.pieces
        return Drafts(*draft(p.head, p.vocab, batch.head_cache, [r.pend for r in rows],
                             [r.pend_t for r in rows], k, pick, batch.head_width))

    def propose_unread(self, batch, prev, k: int, pick: Picker) -> Drafts:
        """The head's pass over prev's hidden states (its unread tokens paired with them,
        the trim of what prev did not keep deferred to `settle`), then k chained drafts."""
        drop_chained_rows(batch, prev.k, len(prev.rows))
        p = self.pieces
        return Drafts(*draft_unread(p.head, p.vocab, batch.head_cache, prev.hidden, prev.tokens,
                                    prev.kept, k, pick, batch.head_width))

    def after_verify(self, batch, cycle, tokens: List[List[int]], consumed: List[int]) -> None:
        drop_chained_rows(batch, cycle.k, len(cycle.rows))
        mtp_inputs.after_cycle(cycle.rows, cycle.hidden, tokens, consumed, cycle.k)
        if cycle.k == 0:
            p = self.pieces
            mtp_inputs.keep_bounded(batch.rows, self.plain_regime(), p.head, p.vocab, batch.head_cache)

    def settle(self, batch, prev, kept: List[int]) -> None:
        bucket = batch.head_cache[0].query_bucket(prev.k + 1, batch.head_width)
        batch.head_cache.settle([bucket - 1 - n for n in kept])


def drop_chained_rows(batch, k: int, n_rows: int) -> None:
    """Trim the rows the head wrote while chaining drafts 2..k (from its own guesses)."""
    if batch.head_cache is not None and k > 1:
        batch.head_cache.trim_rows([k - 1] * n_rows)
