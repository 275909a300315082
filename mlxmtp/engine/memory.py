"""Memory for running requests: what their caches take, and the budget they share with
the prefix cache.

On Apple GPUs MLX ends the whole process when a command buffer runs out of memory
(`kIOGPUCommandBufferCallbackErrorOutOfMemory` is raised where Python cannot catch it),
so caches that outgrow the machine would take every request down with them. Several
agents with long prompts on a large model get there: Qwen3.5-27B keeps 64 KiB of KV per
token, and a batch's attention buffers hold every row at the capacity of its longest
(`RaggedKVCache`: [rows, heads, capacity, dim] per layer). So the engine keeps, by this
module's arithmetic:

* the server's context length at what one row can reach alone (a longer prompt gets the
  API's own "prompt is too long" 400, on which Claude Code compacts its history);
* a new prompt waiting until the batch it joins fits, with room to grow (`admissible`);
* a batch that outgrows the budget giving back the prefix cache's entries first, then
  sending its newest rows back to wait (`overflow`). Such a row resumes by prefilling
  its prompt and the tokens it had emitted (vLLM's recompute preemption), and then goes
  on from there: the client sees a pause, not an error.

The sizes come from the model's own cache arrays: a one-token forward on scratch caches
is built but never evaluated, so its shapes and dtypes cost no computation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Set, Tuple

import mlx.core as mx

from ..mlxlm import adapter
from ..mlxlm.ragged_cache import RaggedKVCache
from .limits import MAX_CYCLE_DEPTH

# Positions a row must be able to grow by before it is admitted: a preemption then
# follows an admission only after this many tokens more, never at once.
ADMIT_HEADROOM = 2 * RaggedKVCache.step


@dataclass(frozen=True)
class Footprint:
    """What one row's caches take."""

    per_position: int  # bytes of attention K and V per position, every layer (main model and head)
    per_row: int  # bytes at any length: Gated DeltaNet conv and recurrent state
    step: int = RaggedKVCache.step  # positions the attention buffers grow by

    def bytes(self, rows: int, positions: int) -> int:
        """`rows` rows in buffers with room for `positions` each (capacity in whole steps)."""
        capacity = -(-positions // self.step) * self.step
        return rows * (capacity * self.per_position + self.per_row)

    def max_positions(self, budget: int) -> int:
        """The most positions one row may reach within `budget` bytes."""
        if self.per_position <= 0:
            return 1 << 62
        return max(0, (budget - self.per_row) // self.per_position // self.step * self.step)


def measure(pieces) -> Footprint:
    """The caches of one row of `pieces` (engine.pieces.ModelPieces), from their shapes."""
    cache = adapter.make_cache(pieces.parts, 1)
    adapter.forward(pieces.parts, mx.zeros((1, 1), dtype=mx.int32), cache, pieces.hidden_state)
    per_position, per_row = cache.footprint()
    if pieces.head is not None:
        # The head's layers are decoder layers of the model's own attention shape.
        attention = len(cache.attention())
        if attention:
            per_position += per_position // attention * len(adapter.make_head_cache(pieces.head, 1))
    return Footprint(per_position, per_row)


def device_limit() -> int:
    """Bytes the device can hold: Metal's recommended working set (past it the GPU
    pages), else the device's memory, else the machine's."""
    info = mx.device_info()
    limit = info.get("max_recommended_working_set_size") or info.get("memory_size")
    return int(limit or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def default_budget(weights: int) -> int:
    """Bytes the caches of running requests and the prefix cache may take together: the
    device's limit less the weights and a reserve (a tenth, at least 1 GiB) for what a
    step allocates on its way (activations, logits, the verify's recorded Gated DeltaNet
    states: up to 512 MiB) and MLX's buffer cache."""
    limit = device_limit()
    return max(0, limit - max(limit // 10, 1 << 30) - weights)


class Room:
    """The `budget` bytes running rows and the prefix cache share (0: unbounded), and what
    the rows take of it now: the guard writes `running`, the prefix cache reads `left`.
    Built before both, so neither has to set the other's fields."""

    def __init__(self, budget: int):
        self.budget = budget
        self.running = 0  # bytes the rows of the guard's last check take

    def left(self) -> int:
        """Bytes the running rows leave the prefix cache."""
        return max(0, self.budget - self.running)


class MemoryGuard:
    """Keeps running rows and the prefix cache within `room`'s budget."""

    def __init__(self, footprint: Footprint, room: Room, prefix_cache):
        self.footprint = footprint
        self.room = room
        self.prefix_cache = prefix_cache  # built with `room.left` as its limit (engine/parts.py)
        self.preempted = 0  # rows sent back to wait, in all

    @property
    def budget(self) -> int:
        return self.room.budget

    @property
    def running(self) -> int:
        return self.room.running

    @running.setter
    def running(self, nbytes: int) -> None:
        self.room.running = nbytes

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def max_positions(self) -> int:
        """The most positions one row can reach, the prefix cache emptied."""
        return self.footprint.max_positions(self.budget) if self.enabled else 1 << 62

    def need(self, lengths: Sequence[int]) -> int:
        """Bytes of a batch whose rows reach `lengths` positions."""
        return self.footprint.bytes(len(lengths), max(lengths)) if lengths else 0

    def reserve(self, lengths: Sequence[int]) -> bool:
        """Whether rows reaching `lengths` fit; if they do, they are what runs now
        (`running`), and prefix-cache entries are evicted to make room for them."""
        if not self.enabled:
            return True
        need = self.need(lengths)
        if need > self.budget:
            return False
        if need + self.prefix_cache.bytes > self.budget:
            self.prefix_cache.shrink_to(self.budget - need)
        self.running = need
        return True

    def admissible(self, active: Sequence[int], started: Sequence[int], unstarted: Sequence[int]) -> int:
        """How many of the rows waiting to start their prefill (`unstarted`, in queue order)
        may start now, next to the active rows (`active`) and the rows already prefilling
        (`started`); each given as the positions it reaches in its next (or first) cycle,
        and admitted with ADMIT_HEADROOM more. In queue order: the first that does not fit
        stops the ones behind it, so a long prompt is not starved by short ones. A row with
        nothing else running always starts (the server's context length keeps it within
        the budget)."""
        if not self.enabled:
            return len(unstarted)
        lengths = [n + ADMIT_HEADROOM for n in [*active, *started]]
        self.running = self.need([*active, *started])
        for i, n in enumerate(unstarted):
            lengths.append(n + ADMIT_HEADROOM)
            if not self.reserve(lengths) and len(lengths) > 1:
                return i
        return len(unstarted)

    def overflow(self, active: Sequence[int], started: Sequence[int]) -> int:
        """How many of the newest active rows must leave so the others' next cycle fits
        (never the oldest: a lone row fits by the server's context length)."""
        if not self.enabled:
            return 0
        lengths = list(active)
        while not self.reserve([*lengths, *started]) and len(lengths) > 1:
            lengths.pop()
        self.running = self.need([*lengths, *started])
        return len(active) - len(lengths)


def next_lengths(rows) -> List[int]:
    """Positions each active row reaches in its next cycle, at the deepest (its cache holds
    all its tokens but the last; the cycle feeds that one and its drafts)."""
    return [len(r.tokens) + MAX_CYCLE_DEPTH for r in rows]


def _prefilled_lengths(rows) -> List[int]:
    """What rows reach in their first cycle once their prefill is done."""
    return [len(r.prompt) + 1 + MAX_CYCLE_DEPTH for r in rows]


def startable(guard: MemoryGuard, rows, waiting) -> Optional[Set[int]]:
    """Request ids of the `waiting` rows (engine.state.Row) that may start their prefill
    next to the active `rows`, or None: all (an unbounded guard). Rows already started
    always go on."""
    if not guard.enabled:
        return None
    unstarted = [r for r in waiting if r.cache is None]
    started = _prefilled_lengths([r for r in waiting if r.cache is not None])
    n = guard.admissible(next_lengths(rows), started, _prefilled_lengths(unstarted))
    return {r.req.id for r in unstarted[:n]}


def overflow(guard: MemoryGuard, rows, waiting) -> int:
    """How many of the newest active rows must go back to wait before the next cycle."""
    started = _prefilled_lengths([r for r in waiting if r.cache is not None])
    return guard.overflow(next_lengths(rows), started) if guard.enabled and rows else 0


def after_drop(guard: MemoryGuard, rows, waiting) -> None:
    """What runs once rows have left: until the next check, /metrics would otherwise show
    the batch before (an idle server holding its last request's bytes)."""
    if guard.enabled:
        guard.running = guard.need([*next_lengths(rows),
                                    *_prefilled_lengths([r for r in waiting if r.cache is not None])])


def sizes(pieces, budget: int, agree: Optional[Callable[[int], int]] = None) -> Tuple[Footprint, Room]:
    """(one row's footprint, the room of `budget` bytes) of the engine of `pieces`; `agree`:
    a distributed rank's way to take rank 0's numbers (every rank must admit and preempt the
    same rows, while each holds other layers)."""
    footprint = measure(pieces) if budget > 0 else Footprint(0, 0)
    if agree is not None:
        footprint = Footprint(agree(footprint.per_position), agree(footprint.per_row))
        budget = agree(budget)
    return footprint, Room(budget)
