"""Suffix drafting (issue 44): a model-free drafter that proposes what the request's prompt,
its output so far and this server's recent outputs say comes after the output's last tokens.

The data structure. A `TokenIndex` holds a token stream in a numpy buffer, -1 (`SEP`, never a
token) before its start, between its sequences and after its end. Each position p has a key,
the tokens at p, p - 1 and p - 2 packed into an int64 (21 bits each, the latest highest); the
keys are sorted with their positions beside them, so the positions where the context's last
1, 2 or 3 tokens end are one range, found by binary search (positions appended since the last
sort are found by a vector comparison, and merged once they pass `live_max`: a 30k-token
prompt is one sort, appending a token is a store). The set of positions where a string ends
is a node of the suffix trie over the stream (this is a suffix array of the reversed stream,
cut to 3 tokens), and its size is that node's count: narrowing the set backwards, a block of
context tokens per vector comparison, finds the longest match of the context's last tokens
(at most `max_match`) and where it occurs; narrowing it forwards by a token walks to a child.
Nothing is stored per node: 16 bytes a token (token, key, position) however repetitive the
text. Occurrences with nothing after them (the context's own at the stream's end, the ends
of sequences) are not counted; a match seen more than _MAX_SEEN times counts its latest.

The scoring, from SuffixDecoding (Oliaro et al., NeurIPS 2025): from the longest match, the
draft follows the most frequent next token (ties: the one seen last), each step multiplying
the path's probability by that token's share of the continuations; it stops where that would
fall below `min_prob`, at `max_len` tokens, and at `spec_factor * match_len + spec_offset`
tokens (a short match is weak evidence). probs[i] estimates P(the first i + 1 draft tokens
are all kept), and their sum (`Draft.score`) the expected number of kept draft tokens, which
a policy can weigh against the MTP head's.

`SharedOutputs` holds finished requests' outputs (never prompts), first in, first out under a
cap in tokens, in a few chunks (TokenIndexes): eviction drops the oldest chunk and its arrays.
A `SuffixDrafter` is one request's: its own index over prompt and output, read beside the
shared chunks; the match length is the longest over them all, and the continuation counts
are summed over those that reach it (as one trie over all of them would count). Not
thread-safe: one engine thread appends and proposes.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

SEP = -1  # never a token: pads a stream's start, separates its sequences, follows its end
KEY_LEN = 3  # tokens in a key: the one at a position and the two before it
_BITS = 21  # bits of a token in a key (every vocabulary known is under 2**18)
_SEP_CODE = (1 << _BITS) - 1  # SEP in a key; token ids must be below it
_ONE_SHOT = 16  # at most this many occurrences: their agreed continuation is taken at once
_BLOCK = 1024  # tokens compared at once when a match is extended backwards
_MAX_SEEN = 256  # occurrences of a match whose continuations are counted: the latest
MAX_MATCH = 32  # the longest match looked for: a Draft's match_len is at most this
_NONE = np.empty(0, np.int32)


class Draft(NamedTuple):
    """tokens: the proposal; probs[i]: the estimated probability that tokens[: i + 1] are
    all kept; match_len: how many of the context's last tokens the proposal rests on."""

    tokens: List[int]
    probs: List[float]
    match_len: int

    @property
    def score(self) -> float:
        """The expected number of accepted draft tokens, by the estimate."""
        return float(sum(self.probs))


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
        self.keys, self.pos = np.empty(0, np.int64), _NONE
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
        j, found = 0, _NONE
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
        return (j, found) if len(found) and j >= self.min_match else (0, _NONE)


def _mode(nxt: np.ndarray) -> Tuple[int, int]:
    """The most frequent token of nxt (ties: the one that occurs last) and its count."""
    if (nxt == nxt[0]).all():
        return int(nxt[0]), int(nxt.size)
    vals, counts = np.unique(nxt, return_counts=True)
    top = vals[counts == counts.max()]
    token = top[0] if len(top) == 1 else nxt[np.isin(nxt, top).nonzero()[0][-1]]
    return int(token), int(counts.max())


def _latest(parts: List[Tuple[np.ndarray, np.ndarray]]) -> List[Tuple[np.ndarray, np.ndarray]]:
    """The last _MAX_SEEN occurrences (the counts of text that repeats itself all along are
    estimated from its latest occurrences)."""
    kept, left = [], _MAX_SEEN
    for buf, at in reversed(parts):
        kept, left = [(buf, at[max(0, len(at) - left):])] + kept, left - len(at)
    return kept


def _agreed_run(parts: List[Tuple[np.ndarray, np.ndarray]], k: int) -> np.ndarray:
    """The next tokens (at most k) on which every occurrence agrees, none of them SEP: when
    the occurrences are few, the draft takes them at once, at an unchanged probability."""
    if sum(len(at) for _, at in parts) > _ONE_SHOT:
        return _NONE
    ahead = np.arange(1, k + 1)
    rows = np.concatenate([np.take(buf, at[:, None] + ahead, mode="clip") for buf, at in parts])
    agree = (rows == rows[0]).all(axis=0) & (rows[0] >= 0)  # a buffer ends with SEP: clip is safe
    return rows[0, :k if agree.all() else int(agree.argmin())]


def _walk(parts: List[Tuple[np.ndarray, np.ndarray]], limit: int,
          min_prob: float) -> Tuple[List[int], List[float]]:
    """Follows the most frequent continuation from the matched string's end positions,
    parts being (stream buffer, positions) from the oldest index to the newest."""
    tokens, probs, prob = [], [], 1.0
    while len(tokens) < limit:
        run = _agreed_run(parts, limit - len(tokens))
        if run.size:
            tokens, probs = tokens + run.tolist(), probs + [prob] * run.size
            parts = [(buf, at + run.size) for buf, at in parts]
            continue
        nxt = [buf[at + 1] for buf, at in parts]
        every = np.concatenate(nxt)
        valid = every[every >= 0]
        if valid.size == 0:
            break
        token, count = _mode(valid)
        if prob * (count / valid.size) < min_prob:
            break
        prob *= count / valid.size
        tokens.append(token)
        probs.append(prob)
        parts = [(buf, at[t == token] + 1) for (buf, at), t in zip(parts, nxt)]
    return tokens, probs


class SharedOutputs:
    """Finished requests' outputs, first in, first out, under cap_tokens tokens: `chunks`
    TokenIndexes of about cap_tokens / chunks tokens; the oldest is dropped whole."""

    def __init__(self, cap_tokens: int = 1 << 20, chunks: int = 4, min_match: int = 2,
                 max_match: int = MAX_MATCH, live_max: int = 0) -> None:
        self.cap, self.chunk_cap = cap_tokens, max(1, cap_tokens // max(1, chunks))
        self._index_args = dict(min_match=min_match, max_match=max_match, live_max=live_max)
        self.chunks: Deque[TokenIndex] = deque()
        # Counted after each `add`: plain ints that a /metrics scrape reads from another thread.
        self.tokens = self.nbytes = 0

    def add(self, output: Sequence[int]) -> None:
        """Adds one finished output (its last cap_tokens tokens when longer)."""
        output = list(output)[-self.cap:] if self.cap > 0 else []
        if not output:
            return
        if not self.chunks or self.chunks[-1].tokens + len(output) > self.chunk_cap:
            self.chunks.append(TokenIndex(**self._index_args))
        self.chunks[-1].extend(output, separate=True)
        self.tokens = sum(c.tokens for c in self.chunks)
        while self.tokens > self.cap and len(self.chunks) > 1:
            self.tokens -= self.chunks.popleft().tokens
        self.nbytes = sum(c.nbytes for c in self.chunks)


class SuffixDrafter:
    """One request's suffix drafter: an index over its prompt and output (append each emitted
    token), over another rendering of its prompt (`view`: JSON-escaped, as a tool call's string
    argument copies it; never output) and the server's shared outputs (`finish` adds this one's)."""

    def __init__(self, prompt: Sequence[int], shared: Optional[SharedOutputs] = None, *, view: Sequence[int] = (),
                 min_match: int = 2, max_match: int = MAX_MATCH, spec_factor: float = 1.0,
                 spec_offset: float = 0.0, min_prob: float = 0.1, live_max: int = 1024) -> None:
        self.index = TokenIndex(prompt, min_match, max_match, live_max)
        self.view = TokenIndex(view, min_match, max_match, live_max=0) if len(view) else None
        self.prompt_len, self.shared = len(prompt), shared
        self.max_match, self.spec_factor, self.spec_offset = max_match, spec_factor, spec_offset
        self.min_prob = min_prob

    def append(self, token: int) -> None:
        self.index.append(token)

    def extend(self, tokens: Sequence[int]) -> None:
        self.index.extend(tokens)

    def output(self) -> List[int]:
        start = self.index.pad + self.prompt_len
        return self.index.buf[start:self.index.n].tolist()

    def finish(self) -> None:
        """Hands the output to the shared index (call once, when the request ends)."""
        if self.shared is not None:
            self.shared.add(self.output())

    def propose(self, context_tail: Optional[Sequence[int]] = None, max_len: int = 32) -> Draft:
        """The draft that follows context_tail (default: this request's last tokens)."""
        ix = self.index
        ctx = (ix.buf[max(ix.pad, ix.n - self.max_match):ix.n] if context_tail is None
               else np.asarray(context_tail, dtype=np.int32)[-self.max_match:])
        ctx_rev = np.ascontiguousarray(ctx[::-1])
        # Oldest first: the request's own text last, so that its occurrences count as the latest.
        indexes = [*(self.shared.chunks if self.shared is not None else []), *filter(None, [self.view]), ix]
        found = [(i.buf, *i.match(ctx_rev)) for i in indexes]
        length = max(m for _, m, _ in found)
        limit = min(max_len, int(length * self.spec_factor + self.spec_offset + 1e-6))
        if length == 0 or limit <= 0:
            return Draft([], [], length)
        return Draft(*_walk(_latest([(b, at) for b, m, at in found if m == length]), limit,
                            self.min_prob), length)
