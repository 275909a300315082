"""Scheduling: what enters and leaves the batch between decode cycles.

Other threads hand requests and cancellations to the `Inbox`; each step takes them all
at once. A new request waits (`BatchGenerator.waiting`) until its prompt is prefilled
(see prefill), then joins the batch (`state.Batch`); a cancelled, failed or finished
row leaves it. A finished row leaves its state to the prefix cache, for a later request
that continues it (the next turn of a conversation).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, List, Optional, Set, Tuple

import mlx.core as mx

from .failures import RowFailure, blame
from .output import failed
from .prefix.cache import PrefixCache
from .proposers.mtp_head import pending_array
from .request import Event, Request
from .state import Batch, Row


class Inbox:
    """Requests and cancellations from other threads, taken by the engine once per step."""

    def __init__(self):
        self._lock = threading.Lock()
        self._requests: deque = deque()
        self._cancelled: Set[int] = set()

    def put(self, req: Request) -> None:
        with self._lock:
            self._requests.append(req)

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self._cancelled.add(request_id)

    def take(self) -> Tuple[List[Request], Set[int]]:
        """Everything handed over so far: (new requests, cancelled request ids)."""
        with self._lock:
            new, self._requests = list(self._requests), deque()
            cancelled, self._cancelled = self._cancelled, set()
        return new, cancelled

    def __len__(self) -> int:
        """Requests not taken yet."""
        return len(self._requests)

    @property
    def has_changes(self) -> bool:
        """Requests or cancellations not taken yet."""
        return bool(self._requests or self._cancelled)

    def requests(self) -> List[Request]:
        with self._lock:
            return list(self._requests)

    def cancelled_ids(self) -> Set[int]:
        with self._lock:
            return set(self._cancelled)


def admit(requests: List[Request], make_row: Callable[[Request], Row], waiting: deque,
          events: List[Event]) -> None:
    """Queue a row for each new request; one whose row cannot be made fails alone."""
    for req in requests:
        try:
            with blame(req.id):
                waiting.append(make_row(req))
        except RowFailure as f:
            events.append(failed(req.id, f, None))


def cancel(cancelled: Set[int], waiting: deque, rows: List[Row], events: List[Event],
           keep_partial: Callable[[Row], None]) -> List[int]:
    """Cancel waiting and active rows (`keep_partial`: what a waiting row's prefill reached
    is kept, see Prefiller.keep_partial); -> the batch indices of the active ones (to drop)."""
    if not cancelled:
        return []
    for r in [r for r in waiting if r.req.id in cancelled]:
        keep_partial(r)
        waiting.remove(r)
        events.append(Event(r.req.id, [], "", "cancelled", stats=r.stats))
    gone = [i for i, r in enumerate(rows) if r.req.id in cancelled]
    for i in gone:
        events.append(Event(rows[i].req.id, [], "", "cancelled", stats=rows[i].stats))
    return gone


def fail(failures: List[RowFailure], rows: List[Row], events: List[Event]) -> List[int]:
    """Fail the active rows the failures blame; -> their batch indices (to drop)."""
    ids = {f.request_id: f for f in failures}
    gone = [i for i, r in enumerate(rows) if r.req.id in ids]
    for i in gone:
        events.append(failed(rows[i].req.id, ids[rows[i].req.id], rows[i].stats))
    return gone


def store_finished(prefix_cache: PrefixCache, batch: Batch, finished: List[int], k: int, in_flight=None) -> None:
    """Store the finished rows' states in the prefix cache as they leave the batch. `k`: the
    depth of the cycle they finished in; `in_flight`: the cycle already built on that one
    (engine.cycle.Cycle: its depth and hidden states), if any."""
    if prefix_cache.max_bytes <= 0 or not finished:
        return
    if in_flight is None:
        fed_last = None  # each state covers its row's tokens but the last one emitted
    elif k == 0 and in_flight.k == 0:
        fed_last = in_flight.hidden  # the plain cycle in flight has fed every row's last token
    else:
        return  # a drafting cycle in flight: the rollbacks it was built on are not settled
    for b in finished:
        _store_row(prefix_cache, batch, b, fed_last)


def _store_row(prefix_cache: PrefixCache, batch: Batch, b: int, fed_last: Optional[mx.array]) -> None:
    """Row b's state, after all its tokens if `fed_last` ([B, 1, H]: the hidden states after
    each row's last token) is given, else after all but the last."""
    row = batch.rows[b]
    with_head = batch.head_cache is not None
    cache = batch.cache.extract_row(b)
    head_cache = batch.head_cache.extract_row(b) if with_head else None
    unfed = 0 if fed_last is not None else 1
    pend_t = row.pend_t[: len(row.pend_t) - unfed] if with_head else []
    pend_h = pending_array(row.pend) if with_head else None
    if pend_h is not None:
        # One hidden more than the tokens paired with them: the last waits for the token
        # after the state (the next turn's first).
        pend_h = pend_h[: len(pend_t) + 1] if fed_last is None else mx.concatenate([pend_h, fed_last[b]])
    # Stored without logits: it only seeds longer prompts (the next turn of a conversation),
    # which prefill at least one more token anyway.
    prefix_cache.store(row.tokens[: len(row.tokens) - unfed], cache, head_cache, pend_h, pend_t, None)
