"""What the engine asks at its synchronisation points, answered for a process alone.

The engine (batch.py) is the same code in a process of its own and on every rank of a
distributed run, where the ranks run it in lockstep (mlxmtp/distributed/). What could make
the ranks differ is settled at a few points, each a method here; this class is the answer
of a process alone, and distributed/coordinator.py's the answer of a rank:

* `agree`: the sizes the prefix cache and the memory guard keep, evict and admit by (each
  rank holds other layers, so each would measure other sizes); here a size as it is;
* `policy`: the depth policy the engine asks (its answers read a clock); here as given;
* `after_cycle`: every cycle's kept counts and tokens (the ranks check they decoded the
  same); here nothing.

The step's input is the engine's inbox on every rank: a rank's driver fills it from rank
0's message before each step (distributed/engine.py). The parts get these answers when
they are built (engine/parts.py), never later.
"""

from __future__ import annotations

from typing import Callable, List, Optional

from .policy.base import Policy


class Coordinator:
    # Whether other processes run this engine in step: their sizes are then agreed, and a
    # part that may skip work on its own (a prefix-cache entry it has no memory to copy)
    # must not (prefix/cache.py).
    lockstep = False

    def agree(self, nbytes: int) -> int:
        """The size every process uses where this one measured `nbytes`."""
        return nbytes

    def agreement(self) -> Optional[Callable[[int], int]]:
        """`agree` for the parts that take sizes, or None when there is nothing to agree."""
        return self.agree if self.lockstep else None

    def policy(self, policy: Policy) -> Policy:
        """The depth policy the engine asks, from the model's own (engine/pieces.shared_policy)."""
        return policy

    def after_cycle(self, kept: List[int], tokens: List[List[int]]) -> None:
        """A cycle's results, as read on the host (before they are emitted)."""
