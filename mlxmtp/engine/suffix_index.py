"""Suffix drafting (issue 44): a model-free drafter that proposes what the request's prompt,
its output so far and this server's recent outputs say comes after the output's last tokens.
The matches come from engine/token_index.py: where the context's last tokens occur in a
token stream, and how often.

The scoring, from SuffixDecoding (Oliaro et al., NeurIPS 2025): from the longest match, the
draft follows the most frequent next token (ties: the one seen last), each step multiplying
the path's probability by that token's share of the continuations; it stops where that would
fall below `min_prob`, at `max_len` tokens, and at `spec_factor * match_len + spec_offset`
tokens (a short match is weak evidence). probs[i] estimates P(the first i + 1 draft tokens
are all kept), and their sum (`Draft.score`) the expected number of kept draft tokens, which
a policy can weigh against the MTP head's. A match seen more than _MAX_SEEN times counts
its latest occurrences.

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

from .token_index import MAX_MATCH, NO_POSITIONS, TokenIndex

_ONE_SHOT = 16  # at most this many occurrences: their agreed continuation is taken at once
_MAX_SEEN = 256  # occurrences of a match whose continuations are counted: the latest


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
        return NO_POSITIONS
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

    def clear(self) -> None:
        """Forgets every output held."""
        self.chunks.clear()
        self.tokens = self.nbytes = 0


class SuffixDrafter:
    """One request's suffix drafter: an index over its prompt and output (append each emitted
    token), over other renderings of its prompt (`views`: JSON-escaped, as a tool call's string
    argument copies it; a Read tool's listing without its line numbers; its lines behind a
    patch's marks: proposers/views.py; never output) and the server's shared outputs
    (`finish` adds this one's)."""

    def __init__(self, prompt: Sequence[int], shared: Optional[SharedOutputs] = None, *, views: Sequence[Sequence[int]] = (),
                 min_match: int = 2, max_match: int = MAX_MATCH, spec_factor: float = 1.0,
                 spec_offset: float = 0.0, min_prob: float = 0.1, live_max: int = 1024) -> None:
        self.index = TokenIndex(prompt, min_match, max_match, live_max)
        self.view: Optional[TokenIndex] = None
        self.prompt_len, self.shared = len(prompt), shared
        self.min_match, self.max_match, self.spec_factor, self.spec_offset = min_match, max_match, spec_factor, spec_offset
        self.min_prob = min_prob
        self.add_views(views)

    def add_views(self, views: Sequence[Sequence[int]]) -> None:
        """Indexes more renderings of the prompt: one index, each rendering its own sequence
        (no match crosses two)."""
        for view in views:
            if self.view is None:
                self.view = TokenIndex(min_match=self.min_match, max_match=self.max_match, live_max=0)
            self.view.extend(view, separate=True)

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
