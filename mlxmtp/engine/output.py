"""Output: a row's new tokens become text and events; stop tokens, stop strings and
max_tokens end it.

A cycle emits up to k+1 tokens per row at once; a row that finishes part-way consumes
only the tokens up to its end, and the cycle rolls its caches back to exactly those.
Text that could still grow into a stop string is held back until it cannot.
"""

from __future__ import annotations

import logging
import math
from typing import List, Optional, Tuple

from .failures import RowFailure, blame
from .request import Event, RequestStats
from .state import Row

log = logging.getLogger("mlxmtp")


def emit_cycle(rows: List[Row], k: int, kept: List[int], tokens: List[List[int]],
               tables: Optional[list], events: List[Event],
               drafted: Optional[List[Tuple[str, int]]] = None) -> Tuple[List[int], List[int]]:
    """Emit one cycle's tokens for every row: row b's are tokens[b][: kept[b] + 1];
    drafted[b]: (the drafter, the drafts it made for row b) where not all k are the head's.

    Returns (tokens each row consumed, batch indices of the rows that finished). A row
    whose output fails (e.g. its detokenizer raises) fails alone and finishes here."""
    finished, consumed = [], []
    for b, row in enumerate(rows):
        emitted = tokens[b][: kept[b] + 1]
        row.stats.record_cycle(k, kept[b], *(drafted[b] if drafted else ("mtp", k)))
        try:
            with blame(row.req.id):
                n = emit(row, emitted, events, tables[b] if tables is not None else None)
        except RowFailure as f:
            events.append(failed(row.req.id, f, row.stats))
            n = len(emitted)
        consumed.append(n if n else len(emitted))
        if n:
            finished.append(b)
    return consumed, finished


def emit(row: Row, tokens: List[int], events: List[Event], tables=None) -> int:
    """Append tokens to a row and queue its event. Returns 0 while the row goes on, else
    how many of `tokens` it consumed before finishing (the rest are never emitted).

    `tables`: the tokens' logprob tables (sampling/logprobs.py), None for the first token
    (its table is in row.first_lp)."""
    out, reason, hit = _append(row, tokens)
    stops = row.req.stop
    text = row.detok.text
    if hit is not None:
        text = text[: hit[0]]
    # Hold back text that could still grow into a stop string.
    hold = 0 if reason is not None else max((len(s) - 1 for s in stops), default=0)
    upto = max(row.sent, len(text) - hold)
    delta, row.sent = text[row.sent : upto], upto
    row.text = text
    lp_list = None
    if row.req.logprobs is not None:
        tables = tables if tables is not None else [row.first_lp]
        lp_list = [logprob_entry(t, table, row.req.logprobs) for t, table in zip(out, tables)]
    events.append(Event(row.req.id, out, delta, reason, logprobs=lp_list,
                        stats=row.stats if reason else None, stop=hit[1] if hit is not None else None))
    return len(out) if reason else 0


def _append(row: Row, tokens: List[int]) -> Tuple[List[int], Optional[str], Optional[Tuple[int, str]]]:
    """Add tokens to the row and its detokenizer up to the first that ends it -> (the
    tokens added, why it ended or None, (where in the text, which) stop string ended it)."""
    out, reason, hit = [], None, None
    stops = row.req.stop
    longest = max((len(s) for s in stops), default=0)
    for t in tokens:
        row.tokens.append(t)
        row.generated += 1
        row.stats.generated_tokens += 1
        out.append(t)
        if t in row.stop_ids:
            reason = "stop"
            break
        before = len(row.detok.text)
        row.detok.add_token(t)
        # Only a stop string ending in this token's text is new: search from where one
        # could start (the text before it was searched already).
        if stops and (hit := _find_stop(row.detok.text, stops, max(0, before - longest + 1))) is not None:
            reason = "stop"
            break
        if row.generated >= row.req.max_tokens:
            reason = "length"
            break
    if reason is not None:
        row.detok.finalize()
    return out, reason, hit


def failed(request_id: int, failure: RowFailure, stats: Optional[RequestStats]) -> Event:
    """The final event of a request whose own code failed."""
    log.warning("request %d failed: %s", request_id, failure)
    # A cause naming a request field (`param`) failed on what the request asked for.
    return Event(request_id, [], "", "error", error=f"generation failed: {failure}", stats=stats,
                 error_param=getattr(failure.cause, "param", None))


def _find_stop(text: str, stops: List[str], start: int = 0) -> Optional[Tuple[int, str]]:
    """The earliest stop string in text[start:] -> (its index in text, the string)."""
    best = None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def logprob_entry(token: int, table: list, top_n: int) -> dict:
    """One emitted token's row of a logprob table (sampling/logprobs.py) -> {"token", "logprob", "top": [(id, lp)]};
    tokens a processor ruled out (-inf: a grammar's refused ones) are not among the top."""
    width = (len(table) - 1) // 2
    ids, values = table[1 : 1 + width], table[1 + width :]
    logprob = float(table[0])
    # JSON has no -inf (nor NaN): a token of no probability is written as OpenAI writes one.
    return {"token": token, "logprob": logprob if logprob > -9999.0 else -9999.0,
            "top": [(int(i), float(v)) for i, v in zip(ids[:top_n], values[:top_n]) if math.isfinite(v)]}
