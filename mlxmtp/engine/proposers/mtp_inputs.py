"""The head's pending inputs between decode cycles (see mtp_head.py for what they are).

After a drafting cycle the head has consumed every pending input (its drafts started
from them), so each row's pending inputs become the verify's own hidden states paired
with the tokens emitted after them. In plain decoding (k = 0) nothing consumes them and
they pile up: either the head catches up now and then (`absorb`), or, while the depth
policy stays at plain decoding, the older ones are dropped (`forget`).
"""

from __future__ import annotations

from typing import List

import mlx.core as mx

from ..state import Row
from .mtp_head import Vocab, drop_pending, head_pass

# Pending inputs a row may accumulate while k = 0 before the head catches up.
ABSORB_AFTER = 64
# While the policy stays at k = 0, a row keeps between KEEP_WHILE_PLAIN and FORGET_AFTER
# pending inputs (the older ones are dropped). A probe of drafting depths starts with a
# head pass over all of them, and over a long backlog that pass costs several plain steps.
KEEP_WHILE_PLAIN = 8
FORGET_AFTER = 16


def after_cycle(rows: List[Row], hidden: mx.array, tokens: List[List[int]], consumed: List[int],
                k: int) -> None:
    """hidden [B, k+1, H]: the verify's hidden states; row b's first consumed[b] pair with
    the tokens it emitted (tokens[b][: consumed[b]])."""
    for b, row in enumerate(rows):
        seg = (hidden, b, consumed[b])
        if k > 0:
            row.pend, row.pend_t = [seg], tokens[b][: consumed[b]]
        else:
            row.pend.append(seg)
            row.pend_t = row.pend_t + tokens[b][: consumed[b]]


def keep_bounded(rows: List[Row], plain: bool, head, vocab: Vocab, head_cache: list) -> None:
    """After a k = 0 cycle: bound the rows' backlog. `plain`: the depth policy's regime is
    plain decoding (drop old inputs); otherwise let the head catch up on a long backlog."""
    most = max(len(r.pend_t) for r in rows)
    if plain and most > FORGET_AFTER:
        forget(rows)
    elif not plain and most > ABSORB_AFTER:
        absorb(rows, head, vocab, head_cache)


def forget(rows: List[Row]) -> None:
    """Drop all but the last KEEP_WHILE_PLAIN pending inputs of every row, unseen by the head.

    Keeping the head current costs a head pass per token: where drafting does not pay that
    is a tax on plain decoding for nothing. The head's cache then has a gap; drafts are
    verified, so a later probe or switch back to drafting loses at most some acceptance
    (the head still sees the recent positions), never exactness.
    """
    for r in rows:
        n = len(r.pend_t) - KEEP_WHILE_PLAIN
        if n > 0:
            r.pend, r.pend_t = drop_pending(r.pend, n), r.pend_t[n:]


def absorb(rows: List[Row], head, vocab: Vocab, head_cache: list) -> None:
    """Let the head consume all but the last pending pair of every row (the next drafts
    start from a head pass over at least one)."""
    counts = [len(r.pend_t) - 1 for r in rows]
    if max(counts) <= 0:
        return
    _, rest = head_pass(head, vocab, head_cache, [r.pend for r in rows], [r.pend_t for r in rows], counts)
    for r, n, left in zip(rows, counts, rest):
        r.pend, r.pend_t = left, r.pend_t[n:]
