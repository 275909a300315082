"""Prefix cache: reuse the state left by an earlier request that shares a prefix.

An entry is the complete decoder state after a token sequence: attention KV rows,
Gated DeltaNet conv/recurrent state (which, unlike KV, cannot be cut back to a
shorter prefix, so entries are stored at exact boundaries: the end of a prompt and
the end of a finished request), the MTP head's cache and its pending inputs, and the
logits after the last token. A hit restores all of it and prefills only the rest,
so hit and miss give the same output. Bounded by bytes, least recently used first out.
Arrays are immutable: storing an entry holds references, it copies nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx

from . import mlx_lm_adapter as adapter


@dataclass
class PrefixEntry:
    tokens: Tuple[int, ...]
    cache: list
    head_cache: Optional[list]
    pend_h: Optional[mx.array]  # [n, H] head inputs not yet consumed
    pend_t: List[int]
    last_logits: mx.array  # [V] after the last token
    nbytes: int


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: "OrderedDict[Tuple[int, ...], PrefixEntry]" = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def lookup(self, prompt: List[int]) -> Optional[PrefixEntry]:
        """The longest stored sequence that is a prefix of `prompt` (it may equal it)."""
        best = None
        for key, entry in self.entries.items():
            n = len(key)
            usable = n < len(prompt) or entry.last_logits.size > 0  # equal length needs the logits
            if usable and n <= len(prompt) and (best is None or n > len(best.tokens)) and tuple(prompt[:n]) == key:
                best = entry
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(best.tokens)
        return best

    def store(self, tokens: List[int], cache: list, head_cache: Optional[list], pend_h, pend_t,
              last_logits: mx.array) -> None:
        if self.max_bytes <= 0 or not tokens:
            return
        key = tuple(tokens)
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        cache = adapter.copy_cache(cache)
        head_cache = adapter.copy_cache(head_cache) if head_cache is not None else None
        nbytes = adapter.cache_nbytes(cache) + (adapter.cache_nbytes(head_cache) if head_cache else 0)
        nbytes += (pend_h.nbytes if pend_h is not None else 0) + last_logits.nbytes
        if nbytes > self.max_bytes:
            return
        self.entries[key] = PrefixEntry(key, cache, head_cache, pend_h, list(pend_t), last_logits, nbytes)
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
