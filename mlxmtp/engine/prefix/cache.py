"""Prefix cache: reuse the state left by an earlier request that shares a prefix.

An entry is the complete decoder state after a token sequence: attention KV rows,
Gated DeltaNet conv/recurrent state (which, unlike KV, cannot be cut back to a
shorter prefix, so entries are stored at exact boundaries: the end of a prompt, the
end of a finished request, and where a prompt branches off the sequences stored before
it, see prefill), the MTP head's cache and its pending inputs, and the
logits after the last token. A hit restores all of it and prefills only the rest,
so hit and miss give the same output. Bounded by bytes, and optionally by a number of
entries (`serve --prompt-cache-size`), least recently used first out.
An entry owns compact copies of its arrays (a row's share of a batch's caches, never
views that keep the batch's whole buffers alive), so the byte budget is what it holds.

Lookups walk a radix trie of the stored sequences (prefix_trie.py). With a folder given,
entries it evicts go to disk and come back from there (prefix_disk.py).

mlx-lm's LRUPromptCache / PromptTrie (mlx_lm.models.cache) do not fit these entries:
their lookup answers with a deep copy of a plain prompt cache plus the tokens left (ours
also carries the head's cache, its pending inputs and the logits), may trim a longer entry
back (recurrent state cannot be), skips a one-token prefix, has no notion of an entry
usable only as a strict prefix (ours stored without logits), and evicts by message type
and entry count rather than least recently used under a byte budget.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import mlx.core as mx

from ...mlxlm.model_cache import ModelCache
from .trie import PrefixTrie, Tokens

log = logging.getLogger("mlxmtp")


def default_budget(weights: int = 0) -> int:
    """Bytes for the prefix cache when none is given: a quarter of the device's memory,
    and at most half of what the model's weights (`weights` bytes) leave of it, so a
    model that nearly fills the machine keeps room for its running requests. A long
    agent prompt's state on a large model takes gigabytes (Qwen3.5-27B keeps 64 KiB of
    KV per token: 1.25 GiB for 20K tokens), so a small fixed budget would store none."""
    total = mx.device_info().get("memory_size") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(0, min(int(total) // 4, (int(total) - weights) // 2))


@dataclass
class PrefixEntry:
    tokens: Tokens
    cache: ModelCache
    head_cache: Optional[ModelCache]
    pend_h: Optional[mx.array]  # [n, H] head inputs not yet consumed
    pend_t: List[int]
    last_logits: mx.array  # [V] after the last token; size 0: stored without (a strict prefix only)
    nbytes: int
    boundary: bool = False  # a prefill checkpoint: where other prompts branch off (see prefill)


class PrefixCache:
    def __init__(self, max_bytes: int, max_entries: Optional[int] = None, *,
                 agree: Optional[Callable[[int], int]] = None, room: Optional[Callable[[], int]] = None, disk=None):
        self.max_bytes = max_bytes
        # None: bytes alone bound it. A count would evict the short entries that many
        # prompts share (a system prompt's) as soon as enough long ones are stored.
        self.max_entries = max_entries
        self.entries: "OrderedDict[Tokens, PrefixEntry]" = OrderedDict()  # least recently used first
        self.trie = PrefixTrie()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        # The ranks of a distributed engine must keep and evict the same entries while each
        # holds other layers: `agree` takes rank 0's size for one (engine/coordinator.py).
        self.agree = agree
        # Bytes the running requests leave it (engine/memory.Room.left), None: max_bytes alone.
        self.room = room
        # Where evicted entries go, and are loaded back from (engine/prefix/disk.py), or None.
        self.disk = disk

    def limit(self) -> int:
        """Bytes it may hold now."""
        return self.max_bytes if self.room is None else min(self.max_bytes, self.room())

    def shrink_to(self, nbytes: int) -> None:
        """Evict least recently used entries until it holds at most `nbytes`, and at most
        `max_entries` entries."""
        most = len(self.entries) if self.max_entries is None else self.max_entries
        while self.bytes > max(0, nbytes) or len(self.entries) > most:
            _, old = self.entries.popitem(last=False)
            if self.disk is not None and self._worth_writing(old):
                self.disk.save(old)
            self.trie.remove(old.tokens)
            self.bytes -= old.nbytes

    def lookup(self, prompt: Sequence[int]) -> Optional[PrefixEntry]:
        """The longest stored sequence that is a prefix of `prompt` (it may equal it)."""
        key = tuple(prompt)
        best = self.trie.longest_usable(key, lambda e: e.last_logits.size > 0)
        if self.disk is not None:
            best = self._from_disk(key, best)
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        if best.tokens in self.entries:
            self.entries.move_to_end(best.tokens)
        return best

    def _from_disk(self, key: Tokens, best: Optional[PrefixEntry]) -> Optional[PrefixEntry]:
        """`best`, or a longer stored sequence's state loaded from disk (kept in memory too,
        where it fits)."""
        found = self.disk.lookup(key)
        if found is None or (best is not None and len(found.tokens) <= len(best.tokens)):
            return best
        loaded = self.disk.load(found)
        if loaded is None:
            return best
        if loaded.nbytes <= self.limit():
            held = self.entries.pop(loaded.tokens, None)  # the same tokens stored without logits
            self.bytes -= held.nbytes if held is not None else 0
            self._keep(loaded)
        return loaded

    def _worth_writing(self, entry: PrefixEntry) -> bool:
        """Whether a state is worth a place on disk: a prefill checkpoint (where a system
        prompt and tools end: the next session of an agent whose system prompt does not
        change, as Claude Code's does not, starts there, also after a restart), one that no
        stored sequence extends, or a branch point (the sequences extending it differ right
        after it). A state on the way to a longer one (an earlier turn of a conversation
        stored since) is not: written, every turn of every agent would be, and what a prompt
        starting there and leaving that conversation needs is the checkpoint before it."""
        t = entry.tokens
        return entry.boundary or len(self.trie.next_tokens(t) | self.disk.trie.next_tokens(t)) != 1

    def save_to_disk(self) -> None:
        """Write the entries held in memory to disk (at shutdown), least recently used
        first: those `_worth_writing`."""
        if self.disk is not None:
            for entry in list(self.entries.values()):
                if self._worth_writing(entry):
                    self.disk.save(entry)

    def shared_length(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of `prompt` a stored sequence shares with it (where the
        prompt branches off what was seen before; a state there serves later prompts that
        share as much: see prefill)."""
        if self.max_bytes <= 0:
            return 0
        key = tuple(prompt)
        shared = self.trie.shared_length(key)
        return shared if self.disk is None else max(shared, self.disk.shared_length(key))

    def store(self, tokens: List[int], cache: ModelCache, head_cache: Optional[ModelCache], pend_h, pend_t,
              last_logits: Optional[mx.array], boundary: bool = False) -> None:
        """Keep the state after `tokens`; `last_logits` None: stored without (a strict prefix
        only); `boundary`: see PrefixEntry."""
        if self.max_bytes <= 0 or not tokens:
            return
        if last_logits is None:
            # Made here, on the engine's thread: an array made on another thread (at import)
            # cannot be evaluated on this one.
            last_logits = mx.zeros((0,))
        key = tuple(tokens)
        if key in self.entries:
            self.entries.move_to_end(key)
            self.entries[key].boundary |= boundary
            return
        nbytes = cache.nbytes + (head_cache.nbytes if head_cache else 0)
        nbytes += (pend_h.nbytes if pend_h is not None else 0) + last_logits.nbytes
        if self.agree is not None:
            nbytes = self.agree(nbytes)
        if nbytes > self.limit():
            return
        try:
            entry = _owned_entry(key, cache, head_cache, pend_h, pend_t, last_logits, nbytes)
            entry.boundary = boundary
        except Exception:  # noqa: BLE001 - e.g. no memory for the copy: the cache only saves work
            if self.agree is not None:
                raise  # ranks that skipped different entries would prefill differently
            log.exception("could not store a prefix cache entry of %d tokens; going on without it", len(key))
            return
        self._keep(entry)

    def _keep(self, entry: PrefixEntry) -> None:
        """Hold `entry` (most recently used), then evict what the limit no longer leaves room for."""
        self.entries[entry.tokens] = entry
        self.trie.insert(entry)
        self.bytes += entry.nbytes
        self.shrink_to(self.limit())


def _owned_entry(key: Tokens, cache: ModelCache, head_cache: Optional[ModelCache], pend_h, pend_t: List[int],
                 last_logits: mx.array, nbytes: int) -> PrefixEntry:
    """An entry of copies that own their data, so it holds the bytes it is counted for (a
    view would keep its batch's whole buffers alive: see ModelCache.owned_copy)."""
    cache = cache.owned_copy()
    head_cache = head_cache.owned_copy() if head_cache is not None else None
    pend_h = mx.contiguous(pend_h) if pend_h is not None else None
    last_logits = mx.contiguous(last_logits)
    mx.eval(*cache.arrays(), *(head_cache.arrays() if head_cache else []),
            *([pend_h] if pend_h is not None else []), last_logits)
    return PrefixEntry(key, cache, head_cache, pend_h, list(pend_t), last_logits, nbytes)
