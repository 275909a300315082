"""An idle rank > 0 waits for rank 0's next message without keeping a core busy.

Inside a collective, MLX's ring backend polls its sockets in a loop until the other ranks'
data arrives. A rank > 0 waits for rank 0's next message inside a collective, so an idle
server kept a core busy on every rank > 0 for as long as it was idle. Rank 0's data reaches a
rank's sockets whether or not that rank has joined the collective (the kernel holds it), so an
idle rank first blocks in `select` on the sockets MLX opened until one of them has data, then
joins. Nothing in MLX exposes its sockets: they are the ones `mx.distributed.init` opened.

Where the collectives do not run over those sockets (JACCL's RDMA), no data ever shows there:
each wait lasts its whole patience and the collective after it finds rank 0 already there. A
few of those end the waits for the rest of the run, and the rank waits inside the collective
as before.
"""

from __future__ import annotations

import os
import select
import socket
import stat
import time
from typing import Iterable, Set


def open_sockets() -> Set[int]:
    """This process's file descriptors that are sockets."""
    where = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    found = set()
    for name in os.listdir(where):
        try:
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                found.add(int(name))
        except (OSError, ValueError):  # closed since the listing (the listing's own, say)
            continue
    return found


def _holds_data(fd: int) -> bool:
    """Whether socket `fd` has bytes to read, left there (peeked through a duplicate, which
    closing leaves MLX's open)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as dup:
            return bool(dup.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # no data after all, not connected, failed
        return False


class PeerLinks:
    """The sockets a rank's collectives arrive on, and the wait on them."""

    MISSES = 3  # waits that saw nothing before a collective that found rank 0 there at once

    def __init__(self, fds: Iterable[int], patience: float):
        self.fds = sorted(fds)
        self.patience = patience  # seconds an idle rank 0 never stays silent for
        self.misses = 0

    def wait_for_data(self) -> bool:
        """Block until a peer has sent something (True), or for at most `patience` seconds
        (False; at once when not waiting here). A socket `select` finds ready with nothing
        to read (at end of file, failed, listening: init can leave such) is no link: left out."""
        deadline = time.monotonic() + self.patience
        while self.fds:
            try:
                ready, _, _ = select.select(self.fds, [], [], max(0.0, deadline - time.monotonic()))
            except (OSError, ValueError):  # a socket MLX closed: the collective will say why
                return False
            if not ready:
                return False
            if any(_holds_data(fd) for fd in ready):
                return True
            self.fds = [fd for fd in self.fds if fd not in ready]
        return False

    def joined(self, saw_data: bool, seconds: float) -> None:
        """The collective after a wait took `seconds`. After a wait that saw nothing, one
        that found rank 0 there at once means its data never showed on these sockets; a few
        of those (not a rank 0 that was merely late) end the waits."""
        if saw_data:
            self.misses = 0
        elif seconds < self.patience / 4:
            self.misses += 1
            if self.misses >= self.MISSES:
                self.fds = []
