"""The driver of every rank of a distributed run: one engine per rank, in step.

Every rank runs the same engine code on its share of the layers; the forwards inside it
are collectives (mlx-lm's pipeline: receive the hidden states, run the local layers,
send them on, all-gather), so the ranks must make exactly the same calls in the same
order. What could make them differ is shared from rank 0 instead:

* the requests and cancellations (only rank 0 serves HTTP): at the start of each step,
  one message (channel.py) with everything submitted since the last one, which this
  driver puts in every rank's engine inbox before the engine's step;
* each cycle's depth and the policy's other answers, the sizes the prefix cache and the
  memory guard go by, and a digest of every cycle's tokens: the engine asks its
  coordinator (coordinator.py), built into it by engine/build.py;
* start-up calibration and the end of the run, as messages of their own.

Each rank then verifies, accepts and rolls back its own layers from the same logits, so
a cycle costs one verify pass across the ranks plus one small control collective (the
depth; a step's message is skipped when rank 0 had nothing new to share). A
step that raises or stalls past `dist_timeout` (the calibration: with no progress for as
long) is fatal: `on_fatal` ends the run
(the server fails the requests in flight first); no rank rebuilds alone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from typing import Callable, List, Optional, Sequence, Set

from ..engine.build import build_engine
from ..engine.config import EngineConfig
from ..engine.policy.base import COST_KINDS
from ..engine.request import Event, Request
from .channel import Channel
from .coordinator import RankCoordinator
from .group import PEER_SOCKETS
from .links import PeerLinks
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


class DistributedEngine:
    """A loop around this rank's engine (`engine`): rank 0's steps shared and watched, the
    other ranks following them. It has every member of engine/interface.Engine."""

    def __init__(self, model, tokenizer, config: EngineConfig = EngineConfig(), *, group, dist_timeout: float = 30.0,
                 on_fatal: Optional[Callable[[str], None]] = None):
        if config.prefix_cache_dir:  # each rank would load and evict on its own
            raise ValueError("a prefix cache on disk is not supported across ranks (mlx.launch)")
        # Every rank would read and write the policy's file on its own, where rank 0 decides:
        # across ranks every run starts cold.
        config = dataclasses.replace(config, policy_state_dir=None)
        self.coordinator = RankCoordinator(Channel(group))
        self.engine = build_engine(model, tokenizer, config, self.coordinator)
        self._arrived = threading.Event()
        self.on_fatal = on_fatal or exit_on_fatal
        self.watchdog = Watchdog(dist_timeout, self._fail)
        self.links = PeerLinks(PEER_SOCKETS, patience=2 * HEARTBEAT)
        self.closed = False

    @property
    def leader(self) -> bool:
        return self.coordinator.leader

    @property
    def channel(self) -> Channel:
        return self.coordinator.channel

    # ------------------------------------------------------------ the engine's, as it has them
    @property
    def prefix_cache(self):
        return self.engine.prefix_cache

    @property
    def memory(self):
        return self.engine.memory

    @property
    def cycles(self) -> int:
        return self.engine.cycles

    @property
    def last_depth(self) -> int:
        return self.engine.last_depth

    @property
    def why(self) -> str:
        return self.engine.why

    @property
    def num_active(self) -> int:
        return self.engine.num_active

    def cancelled_ids(self) -> Set[int]:
        return self.engine.cancelled_ids()

    def set_fatal_handler(self, handler: Callable[[str], None]) -> None:
        self.on_fatal = handler

    # ------------------------------------------------------------ rank 0, any thread
    def submit(self, req: Request) -> int:
        req.validate(self.engine.vocab_size, self.engine.max_depth)
        request_to_wire(with_seed(req))  # refuse here what could not be shared
        self.coordinator.outbox.put(req)
        self._arrived.set()
        return req.id

    def cancel(self, request_id: int) -> None:
        self.coordinator.outbox.cancel(request_id)
        self._arrived.set()

    @property
    def has_work(self) -> bool:
        # Rank 0 keeps stepping while idle: an idle step is the heartbeat the others wait on.
        return not self.closed

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + len(self.coordinator.outbox)

    def unstarted_request_ids(self) -> Set[int]:
        return self.engine.unstarted_request_ids() | {r.id for r in self.coordinator.outbox.requests()}

    # ------------------------------------------------------------ every rank, engine thread
    def step(self) -> List[Event]:
        """One step on every rank: rank 0 shares what arrived (waiting up to HEARTBEAT when
        there is nothing to do), then every rank runs the same engine step."""
        if self.leader and not self.engine.has_work and not self.coordinator.outbox.has_changes:
            self._arrived.wait(HEARTBEAT)
        return self._run("a step", self._turn) or []

    def calibrate(self, batch_size: int = 1, progress: Optional[Callable[[], None]] = None,
                  kinds: Sequence[str] = COST_KINDS) -> bool:
        """Rank 0 (the server at start-up) has every rank calibrate; inside a step every rank
        is already at the same call (the engine's own). `progress`: this rank's, beside the
        watchdog's."""
        if self.leader:
            return self._run("calibration", lambda: self._send({"calibrate": batch_size, "kinds": list(kinds)},
                                                               progress))
        return self.engine.calibrate(batch_size, self._alive(progress), kinds)

    def close(self) -> None:
        """Rank 0: tell the other ranks the run is over (they return from `follow`)."""
        if self.leader and not self.closed:
            self._run("closing", lambda: self._send({"stop": True}))
        self.closed = True

    def follow(self) -> None:
        """Ranks > 0: do what rank 0 says until it closes the run; idle, wait for its next
        message outside the collective, where MLX's ring backend would poll (links.py)."""
        while not self.closed:
            idle = not self.engine.has_work and not self.coordinator.quiet
            saw_data = self.links.wait_for_data() if idle else True
            started = time.monotonic()
            self._run("a step", self._turn)
            if idle:
                self.links.joined(saw_data, time.monotonic() - started)

    def _turn(self):
        """One step on this rank: rank 0's message carried out, or after a quiet depth
        choice (shared_policy.py), the step without one."""
        if self.coordinator.quiet:
            return self._quiet_step()
        message, new = None, None
        if self.leader:
            self._arrived.clear()
            new, cancelled = self.coordinator.outbox.take()
            message = {"new": [request_to_wire(r) for r in new], "cancel": sorted(cancelled)}
        return self._carry_out(self._share(message), new)

    def _quiet_step(self):
        self.coordinator.heard()
        return self._carry_out({"new": [], "cancel": []}, [])

    def _send(self, message: dict, progress: Optional[Callable[[], None]] = None):
        """Rank 0: a message outside the steps, once the other ranks are at a message
        (a quiet step they are about to take is taken first)."""
        if self.coordinator.quiet:
            self._quiet_step()
        return self._carry_out(self._share(message), progress=progress)

    def _share(self, message: Optional[dict]) -> dict:
        """Rank 0's message on every rank, with rank 0's digest checked against this rank's."""
        if self.leader:
            message = {**message, "digest": self.coordinator.digest}
        message = self.channel.share(message)
        self.coordinator.check_digest(message["digest"])
        return message

    def _carry_out(self, message: dict, own: Optional[List[Request]] = None,
                   progress: Optional[Callable[[], None]] = None):
        """`own`: rank 0's requests themselves, which the message carries as wire dicts;
        `progress`: a calibration's, beside the watchdog's."""
        if "stop" in message:
            self.closed = True
            return None
        if "calibrate" in message:
            return self.engine.calibrate(message["calibrate"], self._alive(progress), message["kinds"])
        for req in own if own is not None else map(request_from_wire, message["new"]):
            self.engine.inbox.put(req)
        for rid in message["cancel"]:
            self.engine.inbox.cancel(rid)
        events = self.engine.step()
        return events if self.leader else None

    def _alive(self, progress: Optional[Callable[[], None]]) -> Callable[[], None]:
        """The calibration's progress call: the watchdog hears of it, and `progress` too."""
        def alive():
            self.watchdog.alive()
            if progress is not None:
                progress()
        return alive

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
