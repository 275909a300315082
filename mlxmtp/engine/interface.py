"""`Engine`: what the server (server/engine_thread.py, server/metrics.py) and `generate`
call on an engine, declared once. Both the engine of a process alone (batch.BatchGenerator)
and rank 0's driver of a distributed run (distributed/engine.DistributedEngine) have every
member, so their callers need no probing (tests/test_engine_interface.py checks it)."""

from __future__ import annotations

from typing import Callable, List, Optional, Protocol, Sequence, Set

from .memory import MemoryGuard
from .policy.base import COST_KINDS
from .prefix.cache import PrefixCache
from .request import Event, Request


class Engine(Protocol):
    prefix_cache: PrefixCache  # its stats and its disk store (written at shutdown)
    memory: MemoryGuard  # its budget and what running rows take (/metrics)
    cycles: int  # decode cycles run so far
    last_depth: int  # the depth of the last cycle
    why: str  # why the last cycle got its depth

    # Any thread (the server's event loop).
    def submit(self, req: Request) -> int: ...  # raises ValueError on bad input

    def cancel(self, request_id: int) -> None: ...

    # The engine's thread.
    @property
    def has_work(self) -> bool: ...  # whether `step` has anything to do

    @property
    def num_active(self) -> int: ...  # rows decoding

    @property
    def num_waiting(self) -> int: ...  # requests not decoding yet

    def step(self) -> List[Event]: ...

    # The depth policy's cycle costs of these kinds of batches (policy.cost_kind), if it has none yet;
    # `progress()` after each timed run.
    def calibrate(self, batch_size: int = 1, progress: Optional[Callable[[], None]] = None,
                  kinds: Sequence[str] = COST_KINDS) -> bool: ...

    def unstarted_request_ids(self) -> Set[int]: ...  # after a failed step: what may be resubmitted untouched

    def cancelled_ids(self) -> Set[int]: ...  # cancellations not yet applied

    def set_fatal_handler(self, handler: Callable[[str], None]) -> None:
        """What to call when the engine can neither go on nor be rebuilt alone (a
        distributed run that lost a rank); an engine that can be rebuilt ignores it."""

    def close(self) -> None: ...  # the end of the run (a distributed one tells its other ranks)
