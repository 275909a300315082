"""The index under suffix drafting (engine/suffix_index.py): a token stream and where each
short string of it ends, found by binary search.

A `TokenIndex` holds a token stream in a numpy buffer, -1 (`SEP`, never a token) before its
start, between its sequences and after its end. Each position p has a key, the tokens at p,
p - 1 and p - 2 packed into an int64 (21 bits each, the latest highest); the keys are sorted
with their positions beside them, so the positions where the context's last 1, 2 or 3 tokens
end are one range, found by binary search (positions appended since the last sort are found by
a vector comparison, and merged once they pass `live_max`: a 30k-token prompt is one sort,
appending a token is a store). The set of positions where a string ends is a node of the
suffix trie over the stream (this is a suffix array of the reversed stream, cut to 3 tokens),
and its size is that node's count: narrowing the set backwards, a block of context tokens per
vector comparison, finds the longest match of the context's last tokens (at most `max_match`)
and where it occurs; narrowing it forwards by a token walks to a child. Nothing is stored per
node: 16 bytes a token (token, key, position) however repetitive the text. Occurrences with
nothing after them (the context's own at the stream's end, the ends of sequences) are not
counted.

Not thread-safe: one engine thread appends and matches.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

SEP = -1  # never a token: pads a stream's start, separates its sequences, follows its end
KEY_LEN = 3  # tokens in a key: the one at a position and the two before it
_BITS = 21  # bits of a token in a key (every vocabulary known is under 2**18)
_SEP_CODE = (1 << _BITS) - 1  # SEP in a key; token ids must be below it
_BLOCK = 1024  # tokens compared at once when a match is extended backwards
MAX_MATCH = 32  # the longest match looked for: a Draft's match_len is at most this
NO_POSITIONS = np.empty(0, np.int32)


class TokenIndex:
    """One token stream (sequences separated by SEP) and where each key occurs."""

    def __init__(self, tokens: Sequence[int] = (), min_match: int = 2, max_match: int = MAX_MATCH,
                 live_max: int = 1024) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError("need 1 <= min_match <= max_match")
        self.min_match, self.pad, self.live_max = min_match, max(max_match, KEY_LEN), live_max
        self.buf = np.full(2 * self.pad + len(tokens) + 64, SEP, np.int32)
        self.n = self.sealed = self.pad  # buffer index of the next token; of the first unsorted
        self.tokens = 0  # tokens held, separators not counted
        self.keys, self.pos = np.empty(0, np.int64), NO_POSITIONS
        if len(tokens):
            self.extend(tokens)

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes + self.keys.nbytes + self.pos.nbytes

    def append(self, token: int) -> None:
        if not 0 <= token < _SEP_CODE:
            raise ValueError(f"token ids are in [0, {_SEP_CODE}), got {token}")
        self._reserve(1)
        self.buf[self.n] = token
        self.n += 1
        self.tokens += 1
        if self.n - self.sealed > self.live_max:
            self._seal()

    def extend(self, tokens: Sequence[int], separate: bool = False) -> None:
        """Appends tokens; separate=True starts a new sequence (a match never crosses into it)."""
        arr = np.asarray(tokens, dtype=np.int64).ravel()
        if arr.size and (arr.min() < 0 or arr.max() >= _SEP_CODE):
            raise ValueError(f"token ids are in [0, {_SEP_CODE})")
        lead = 1 if separate and self.n > self.pad else 0
        self._reserve(lead + arr.size)
        self.buf[self.n + lead:self.n + lead + arr.size] = arr
        self.n += lead + arr.size
        self.tokens += arr.size
        if self.n - self.sealed > self.live_max:
            self._seal()

    def _reserve(self, k: int) -> None:
        need = self.n + k + 1  # a SEP always follows the last token
        if need > len(self.buf):
            grown = np.full(max(need, len(self.buf) * 3 // 2), SEP, np.int32)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown

    def _keys(self, lo: int, hi: int) -> np.ndarray:
        """The keys of positions lo..hi-1: tokens p, p - 1, p - 2 in 21 bits each, high first."""
        keys = np.zeros(hi - lo, np.int64)
        for back in range(KEY_LEN):
            t = self.buf[lo - back:hi - back].astype(np.int64) & _SEP_CODE  # SEP (-1): all ones
            keys |= t << (_BITS * (KEY_LEN - 1 - back))
        return keys

    def _seal(self) -> None:
        """Merges the unsorted positions into the sorted arrays (a key's positions end up in
        any order: a lookup sorts them; numpy's unstable sort is ten times the faster)."""
        keys = self._keys(self.sealed, self.n)
        order = np.argsort(keys)
        keys, pos = keys[order], (order + self.sealed).astype(np.int32)
        slots = np.searchsorted(self.keys, keys) + np.arange(len(keys))  # theirs once merged
        old = np.ones(len(self.keys) + len(keys), bool)
        old[slots] = False
        merged = np.empty(len(old), np.int64), np.empty(len(old), np.int32)
        for out, before, added in zip(merged, (self.keys, self.pos), (keys, pos)):
            out[old], out[slots] = before, added
        (self.keys, self.pos), self.sealed = merged, self.n

    def _ending(self, ctx_rev: np.ndarray, k: int) -> np.ndarray:
        """Where the context's last k <= KEY_LEN tokens end, followed by a token, in stream order."""
        code = sum(int(ctx_rev[i]) << (_BITS * (KEY_LEN - 1 - i)) for i in range(k))
        lo = self.keys.searchsorted(code)
        hi = self.keys.searchsorted(code + (1 << (_BITS * (KEY_LEN - k))))
        found = self.pos[lo:hi] if hi - lo < 2 else np.sort(self.pos[lo:hi])
        if self.n > self.sealed:
            live = self.buf[self.sealed:self.n] == ctx_rev[0]
            for i in range(1, k):
                live &= self.buf[self.sealed - i:self.n - i] == ctx_rev[i]
            at = live.nonzero()[0]
            if at.size:
                found = np.concatenate([found, (at + self.sealed).astype(np.int32)])
        return found[self.buf[found + 1] >= 0] if found.size else found

    def match(self, ctx_rev: np.ndarray) -> Tuple[int, np.ndarray]:
        """(length of the longest match of the context, where it ends), ctx_rev holding the
        context's tokens last first; (0, none) when not even min_match tokens match."""
        ctx_rev = ctx_rev[:self.pad]  # the SEP padding stops a match at the stream's start
        j, found = 0, NO_POSITIONS
        for k in range(min(KEY_LEN, len(ctx_rev)), min(self.min_match, KEY_LEN) - 1, -1):
            found, j = self._ending(ctx_rev, k), k
            if len(found):
                break
        w = max(4, _BLOCK // max(1, len(found)))
        while len(found) and j < len(ctx_rev):  # compare blocks of the context's earlier tokens
            w = min(len(ctx_rev) - j, w)
            eq = self.buf[found[:, None] - np.arange(j, j + w)] == ctx_rev[j:j + w]
            more = np.where(eq.all(axis=1), w, eq.argmin(axis=1))
            best = int(more.max())
            found, j = found[more == best], j + best
            if best < w:
                break
            w *= 2  # what is left matched all along: take longer blocks
        return (j, found) if len(found) and j >= self.min_match else (0, NO_POSITIONS)
