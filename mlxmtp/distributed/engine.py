"""The engine on every rank of a distributed run: one `BatchGenerator` per rank, in step.

Every rank runs the same engine code on its share of the layers; the forwards inside it
are collectives (mlx-lm's pipeline: receive the hidden states, run the local layers,
send them on, all-gather), so the ranks must make exactly the same calls in the same
order. What could make them differ is shared from rank 0 instead:

* the requests and cancellations (only rank 0 serves HTTP): at the start of each step,
  one message (channel.py) with everything submitted since the last one;
* each cycle's depth and the policy's other answers (shared_policy.py);
* the sizes the prefix cache keeps and evicts by, and the memory guard's (each rank's own
  caches hold other layers);
* start-up calibration and the end of the run, as messages of their own.

Each rank then verifies, accepts and rolls back its own layers from the same logits, so
a cycle costs one verify pass across the ranks plus one small control collective (the
depth; a step's message is skipped when rank 0 had nothing new to share). A
step that raises or stalls past `dist_timeout` is fatal: `on_fatal` ends the run
(the server fails the requests in flight first); no rank rebuilds alone.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import zlib
from typing import Callable, List, Optional

from ..engine import memory
from ..engine.batch import BatchGenerator
from ..engine.config import EngineConfig
from ..engine.request import Event, Request
from ..engine.scheduler import Inbox
from .channel import Channel
from .shared_policy import SharedPolicy
from .watchdog import Watchdog
from .wire import request_from_wire, request_to_wire, with_seed

log = logging.getLogger("mlxmtp.distributed")

EXIT_CODE = 3  # a rank ended because the group failed
HEARTBEAT = 0.5  # seconds an idle rank 0 waits before telling the others it is alive


def exit_on_fatal(message: str) -> None:
    """Default fatal handler: say why on stderr and exit non-zero, at once (a thread stuck
    inside a collective would keep a normal exit waiting)."""
    log.error("distributed run failed: %s", message)
    sys.stderr.write(f"mlxmtp: distributed run failed: {message}\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)


class DistributedEngine(BatchGenerator):
    def __init__(self, model, tokenizer, config: EngineConfig = EngineConfig(), *, group, dist_timeout: float = 30.0,
                 on_fatal: Optional[Callable[[str], None]] = None):
        if config.prefix_cache_dir:  # each rank would load and evict on its own
            raise ValueError("a prefix cache on disk is not supported across ranks (mlx.launch)")
        super().__init__(model, tokenizer, config)
        self.channel = Channel(group)
        self.policy = SharedPolicy(self.policy, self.channel, news=lambda: self.outbox.has_changes,
                                   digest=lambda: self.digest, check=self._check_digest)
        self.digest = 0  # of every cycle's results so far: the ranks compare theirs (_read)
        self.prefix_cache.agree = self._agreed_size
        # Every rank keeps and evicts the same entries, so all use rank 0's budget (each
        # rank's own default is a share of its own machine's memory).
        self.prefix_cache.max_bytes = self._agreed_size(self.prefix_cache.max_bytes)
        # Every rank admits and pauses the same rows (engine/memory.py): all use rank 0's
        # sizes and budget.
        self.memory = memory.guard_for(self.pieces, self.memory.budget, self.prefix_cache, agree=self._agreed_size)
        self.outbox = Inbox()  # rank 0: what submit/cancel handed over since the last step
        self._arrived = threading.Event()
        self.on_fatal = on_fatal or exit_on_fatal
        self.watchdog = Watchdog(dist_timeout, self._fail)
        self.closed = False
        self._stepping = False

    @property
    def leader(self) -> bool:
        return self.channel.leader

    # ------------------------------------------------------------ rank 0, any thread
    def submit(self, req: Request) -> int:
        req.validate(self.vocab_size, self.max_depth)
        request_to_wire(with_seed(req))  # refuse here what could not be shared
        self.outbox.put(req)
        self._arrived.set()
        return req.id

    def cancel(self, request_id: int) -> None:
        self.outbox.cancel(request_id)
        self._arrived.set()

    @property
    def has_work(self) -> bool:
        # Rank 0 keeps stepping while idle: an idle step is the heartbeat the others wait on.
        return not self.closed

    @property
    def num_waiting(self) -> int:
        return super().num_waiting + len(self.outbox)

    def unstarted_request_ids(self):
        return super().unstarted_request_ids() | {r.id for r in self.outbox.requests()}

    # ------------------------------------------------------------ every rank, engine thread
    def step(self) -> List[Event]:
        """One step on every rank: rank 0 shares what arrived (waiting up to HEARTBEAT when
        there is nothing to do), then every rank runs the same engine step."""
        if self.leader and not super().has_work and not self.outbox.has_changes:
            self._arrived.wait(HEARTBEAT)
        return self._run("a step", self._turn) or []

    def calibrate(self, batch_size: int = 1) -> bool:
        """Outside a step (the server at start-up), rank 0 has every rank calibrate; inside
        one, every rank is already at the same call."""
        if self.leader and not self._stepping:
            return self._run("calibration", lambda: self._send({"calibrate": batch_size}))
        return super().calibrate(batch_size)

    def close(self) -> None:
        """Rank 0: tell the other ranks the run is over (they return from `follow`)."""
        if self.leader and not self.closed:
            self._run("closing", lambda: self._send({"stop": True}))
        self.closed = True

    def follow(self) -> None:
        """Ranks > 0: do what rank 0 says until it closes the run."""
        while not self.closed:
            self._run("a step", self._turn)

    def _turn(self):
        """One step on this rank: rank 0's message carried out, or after a quiet depth
        choice (shared_policy.py), the step without one."""
        if self.policy.quiet:
            return self._quiet_step()
        message, new = None, None
        if self.leader:
            self._arrived.clear()
            new, cancelled = self.outbox.take()
            message = {"new": [request_to_wire(r) for r in new], "cancel": sorted(cancelled)}
        return self._carry_out(self._share(message), new)

    def _quiet_step(self):
        self.policy.quiet = False
        return self._carry_out({"new": [], "cancel": []}, [])

    def _send(self, message: dict):
        """Rank 0: a message outside the steps, once the other ranks are at a message
        (a quiet step they are about to take is taken first)."""
        if self.policy.quiet:
            self._quiet_step()
        return self._carry_out(self._share(message))

    def _share(self, message: Optional[dict]) -> dict:
        """Rank 0's message on every rank, with rank 0's digest checked against this rank's."""
        if self.leader:
            message = {**message, "digest": self.digest}
        message = self.channel.share(message)
        self._check_digest(message["digest"])
        return message

    def _carry_out(self, message: dict, own: Optional[List[Request]] = None):
        """`own`: rank 0's requests themselves, which the message carries as wire dicts."""
        if "stop" in message:
            self.closed = True
            return None
        if "calibrate" in message:
            return BatchGenerator.calibrate(self, message["calibrate"])
        for req in own if own is not None else map(request_from_wire, message["new"]):
            self.inbox.put(req)
        for rid in message["cancel"]:
            self.inbox.cancel(rid)
        self._stepping = True
        try:
            events = BatchGenerator.step(self)
        finally:
            self._stepping = False
        return events if self.leader else None

    def _read(self, rec):
        """Every rank accepts drafts from its own copy of the same logits, so the ranks must
        agree bit for bit (ranks of one kind of machine and one MLX do). A digest of each
        cycle's kept counts and tokens travels with rank 0's next message or depth, and a
        rank that computed otherwise stops the run instead of decoding garbage."""
        kept, tokens, tables = super()._read(rec)
        self.digest = zlib.crc32(json.dumps([kept, tokens]).encode(), self.digest)
        return kept, tokens, tables

    def _check_digest(self, leaders: int) -> None:
        if leaders != self.digest:
            raise RuntimeError(f"rank {self.channel.rank} decoded other tokens than rank 0 (mixed machine kinds "
                               "or MLX versions compute different logits); every rank must run the same")

    def _agreed_size(self, nbytes: int) -> int:
        return self.channel.share_ints([nbytes] if self.leader else None, 1)[0]

    def _run(self, what: str, fn):
        with self.watchdog.watch(what):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - any failure breaks the lockstep of the ranks
                log.exception("distributed %s failed", what)
                self._fail(f"{what} failed on rank {self.channel.rank}: {type(e).__name__}: {e}")

    def _fail(self, message: str) -> None:
        self.closed = True
        self.on_fatal(message)
