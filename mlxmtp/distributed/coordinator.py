"""A rank's answers at the engine's synchronisation points (engine/coordinator.py): what
rank 0 decides, shared with every rank over the channel.

* sizes (`agree`): rank 0's, in one small collective each, as the engine's parts are
  built (engine/parts.py) and as the prefix cache stores an entry;
* the depth policy (`policy`): rank 0's answers (shared_policy.py), with whether requests
  wait to be shared (`outbox`) and the digest below;
* every cycle's kept counts and tokens (`after_cycle`): folded into a digest that travels
  with rank 0's next message or depth, checked by every other rank (`check_digest`).
"""

from __future__ import annotations

import json
import zlib
from typing import List, Optional

from ..engine.coordinator import Coordinator
from ..engine.policy.base import Policy
from ..engine.scheduler import Inbox
from .channel import Channel
from .shared_policy import SharedPolicy


class RankCoordinator(Coordinator):
    lockstep = True

    def __init__(self, channel: Channel):
        self.channel = channel
        self.outbox = Inbox()  # rank 0: what submit/cancel handed over since the last step
        self.digest = 0  # of every cycle's results so far: the ranks compare theirs
        self.shared: Optional[SharedPolicy] = None  # the policy the engine asks, once built

    @property
    def leader(self) -> bool:
        return self.channel.leader

    def agree(self, nbytes: int) -> int:
        return self.channel.share_ints([nbytes] if self.leader else None, 1)[0]

    def policy(self, policy: Policy) -> Policy:
        self.shared = SharedPolicy(policy, self.channel, news=lambda: self.outbox.has_changes,
                                   digest=lambda: self.digest, check=self.check_digest)
        return self.shared

    @property
    def quiet(self) -> bool:
        """Rank 0 said at the last depth choice that nothing new waits (shared_policy.py)."""
        return self.shared is not None and self.shared.quiet

    def heard(self) -> None:
        """The quiet step rank 0 announced is being taken."""
        self.shared.quiet = False

    def after_cycle(self, kept: List[int], tokens: List[List[int]]) -> None:
        """Every rank accepts drafts from its own copy of the same logits, so the ranks must
        agree bit for bit (ranks of one kind of machine and one MLX do): a rank that
        computed otherwise stops the run at the next check instead of decoding garbage."""
        self.digest = zlib.crc32(json.dumps([kept, tokens]).encode(), self.digest)

    def check_digest(self, leaders: int) -> None:
        if leaders != self.digest:
            raise RuntimeError(f"rank {self.channel.rank} decoded other tokens than rank 0 (mixed machine kinds "
                               "or MLX versions compute different logits); every rank must run the same")
