"""Prefill: one request at a time (B=1), in chunks, in caches of its own.

A prompt that fits in one chunk is prefilled whole; a long one advances one chunk per
step, so it never stalls the batch for more than a chunk. Once the whole prompt is in,
the row's first token is sampled from the prompt's last logits (as in plain decoding)
and the row joins the batch. The prefix cache seeds a prompt that continues an earlier
one, and keeps the state at the end of every prompt.

Where a prompt branches off the stored sequences (two conversations sharing a long
system prompt), and where the part the server knows other conversations share ends (the
request's `shared_prefix`: its system prompt and tools), its prefill stops to store the
state there (`_checkpoints`).

A row sent back to wait for memory (engine/memory.py) is prefilled the same way over
everything it had fed before (its prompt and all its tokens but the last), and then
rejoins with that last token as its next input, emitting nothing.

The MTP head runs over every prompt position too: each main-model hidden state is paired
with the prompt token after it (across chunk boundaries, the last hidden of a chunk with
the first token of the next), and every complete pair is fed to the head at once.
"""

from __future__ import annotations

import time
from collections import deque
from typing import List, Optional, Set

import mlx.core as mx

from ..mlxlm import adapter
from .failures import RowFailure, blame
from .output import emit, failed
from .pieces import ModelPieces
from .prefix.cache import PrefixCache
from .proposers.mtp_head import head_pass, pending_array, pending_count
from .request import Event
from .sampling.accept import sample_first
from .state import Batch, Row, prompt_left


class Prefiller:
    def __init__(self, pieces: ModelPieces, prefix_cache: PrefixCache, step: int):
        self.pieces = pieces
        self.prefix_cache = prefix_cache
        self.step = step  # tokens per chunk

    def run(self, waiting: deque, batch: Batch, max_batch: int, events: List[Event],
            allowed: Optional[Set[int]] = None) -> None:
        """Short prompts first, each whole, then one chunk of the oldest long prompt.
        `allowed`: the request ids of the rows not started yet that may start (None: all;
        the others wait for memory, see engine/memory.py).

        A prompt that fits in one chunk never waits behind a long one for more than that
        long prompt's current chunk, and a long prompt still advances every step. Chunks
        start at fixed offsets (multiples of the chunk size), whatever else is waiting, so
        a prompt's prefill computes the same numbers under any load."""
        ready = [r for r in waiting if r.cache is not None or allowed is None or r.req.id in allowed]
        budget = self.step
        for row in [r for r in ready if prompt_left(r) <= self.step]:
            if budget <= 0 or len(batch.rows) >= max_batch:
                break
            budget -= prompt_left(row)
            self._advance(row, True, waiting, batch, events)
        long = next((r for r in ready if prompt_left(r) > self.step), None)
        if long is not None and len(batch.rows) < max_batch:
            self._advance(long, False, waiting, batch, events)

    def _advance(self, row: Row, whole: bool, waiting: deque, batch: Batch, events: List[Event]) -> None:
        """Advance `row`'s prefill by one chunk (or to its end), join it to the batch when
        its first token is out. A failure here is the row's alone (its caches are its own)."""
        try:
            with blame(row.req.id):
                ready = self._chunk(row)
                while whole and not ready:
                    ready = self._chunk(row)
                finished = ready and self._first_token(row, events)
        except RowFailure as f:
            waiting.remove(row)
            events.append(failed(row.req.id, f, row.stats))
            return
        if ready:
            waiting.remove(row)
            if not finished:
                batch.join(row)

    def _chunk(self, row: Row) -> bool:
        """Feed `row`'s next prompt chunk; True once the whole prompt is in."""
        prompt = row.prompt
        if row.cache is None:
            row.t0 = time.perf_counter()
            self._start(row)
        # Like mlx-lm: chunks over prompt[:-1], then the last token alone.
        todo = len(prompt) - 1 - row.done_prompt
        if todo > 0:
            n = min(todo, self.step - row.done_prompt % self.step)
            stop = next((c for c in row.checkpoints if c > row.done_prompt), None)
            if stop is not None:
                n = min(n, stop - row.done_prompt)
            self._forward(row, prompt[row.done_prompt : row.done_prompt + n], logits_needed=False)
            row.done_prompt += n
            if row.done_prompt in row.checkpoints:
                self._store(row, None, boundary=True)  # only ever a strict prefix of the prompts it serves
            return False
        if row.done_prompt < len(prompt):
            logits = self._forward(row, prompt[-1:], logits_needed=True)
            row.done_prompt = len(prompt)
            row.last_logits = logits[0, -1]
            self._store(row, row.last_logits)
        return True

    def keep_partial(self, row: Row) -> None:
        """Keep the state a request's prefill reached when it is cancelled part way, as a
        strict prefix of its prompt: a client that gives up on a long prefill and sends the
        same request again (a timeout and a retry: the OpenAI SDKs, Qwen Code after 240 s
        without data) resumes there instead of starting over, which on a long prompt meant
        never finishing. A checkpoint's worth: kept on disk too when memory evicts it."""
        if row.cache is not None and not row.resuming and 0 < row.done_prompt < len(row.prompt):
            self._store(row, None, boundary=True)

    def _store(self, row: Row, last_logits, boundary: bool = False) -> None:
        """Keep the row's state after its first `done_prompt` prompt tokens in the prefix cache
        (`boundary`: a checkpoint, where other prompts are known or expected to branch off)."""
        self.prefix_cache.store(row.prompt[: row.done_prompt], row.cache, row.head_cache,
                                pending_array(row.pend), row.pend_t, last_logits, boundary)

    def _first_token(self, row: Row, events: List[Event]) -> bool:
        """Sample and emit the first token; True if that already finished the request. A
        resuming row has its next token already (emitted before it left the batch)."""
        row.stats.prefill_seconds += time.perf_counter() - row.t0
        if row.resuming:
            row.y, row.resuming, row.last_logits = row.tokens[-1], False, None
            if self.pieces.head is not None:
                row.pend_t.append(row.y)
            return False
        first = sample_first(row, row.last_logits[None])
        row.y = first
        if self.pieces.head is not None:
            row.pend_t.append(first)
        return bool(emit(row, [first], events))

    def _start(self, row: Row) -> None:
        """The row's own caches: from the longest stored prefix of its prompt, or empty."""
        entry = self.prefix_cache.lookup(row.prompt) if self.prefix_cache.max_bytes > 0 else None
        if entry is not None and (self.pieces.head is None) == (entry.head_cache is None):
            row.cache = entry.cache.copy()
            row.head_cache = entry.head_cache.copy() if entry.head_cache is not None else None
            row.pend = [] if entry.pend_h is None else [(entry.pend_h, None, entry.pend_h.shape[0])]
            row.pend_t = list(entry.pend_t)
            row.done_prompt = len(entry.tokens)
            row.last_logits = entry.last_logits
            if not row.resuming:
                row.stats.cached_prompt_tokens = len(entry.tokens)
        else:
            row.cache = adapter.make_cache(self.pieces.parts, 1)
            row.head_cache = adapter.make_head_cache(self.pieces.head, 1) if self.pieces.head is not None else None
        row.checkpoints = self._checkpoints(row)

    def _checkpoints(self, row: Row) -> List[int]:
        """Where the prompt's prefill stops to store its state, in order: where the prompt
        branches off every stored sequence, and where the part other conversations share
        ends (the request's `shared_prefix`), each where a state there is worth storing.

        Entries are only usable whole (Gated DeltaNet state cannot be cut back), so two
        conversations with one long system prompt share nothing until a state at their
        branch point is stored. The first such prompt stores it on the way where the server
        says where its system prompt and tools end; otherwise the second, where it branches
        off the first; every later one starts from it. A shared part shorter than a chunk
        costs at most a chunk to prefill again."""
        done, end = row.done_prompt, len(row.prompt)
        stops = (self.prefix_cache.shared_length(row.prompt), row.req.shared_prefix)
        return sorted({n for n in stops if n - done >= self.step and n < end})

    def _forward(self, row: Row, tokens: List[int], logits_needed: bool) -> mx.array:
        """Run prompt tokens through the main model (and the head) -> logits [1, T, V],
        computed only if `logits_needed`: as in mlx-lm's prefill, a chunk before the last
        token evaluates the caches alone, never the lm_head over its positions (for a
        248K-token vocabulary that would be a sizeable share of a small model's prefill,
        and a transient [T, V] array)."""
        p = self.pieces
        logits, hidden = adapter.forward(p.parts, mx.array(tokens)[None], row.cache, p.hidden_state)
        if p.head is not None:
            done = row.done_prompt
            nh = pending_count(row.pend)
            row.pend.append((hidden[0], None, len(tokens)))
            # Pending hiddens cover positions [done - nh, done + len(tokens)); each pairs
            # with the prompt token after it, where the prompt has one. At a checkpoint the
            # last stays pending, as at a prompt's end: the stored state must not depend on
            # the token after it (the prompts that share the state differ there).
            end = done + len(tokens)
            row.pend_t = row.prompt[done - nh + 1 : end if end in row.checkpoints else end + 1]
            n = len(row.pend_t)
            if n:
                _, rest = head_pass(p.head, p.vocab, row.head_cache, [row.pend], [row.pend_t], [n])
                row.pend, row.pend_t = rest[0], []
        mx.eval(*([logits] if logits_needed else []), *row.cache.arrays(),
                *(row.head_cache.arrays() if row.head_cache else []), *[a for a, _, _ in row.pend])
        return logits
