"""A rank that dies or stalls must not hang the others: every collective step runs under
a watchdog, and one silent for longer than the timeout (`--dist-timeout`: no end, and no
`alive()` from a long block such as the start-up calibration) calls the engine's fatal
handler from the watchdog thread (the engine thread is then stuck inside a collective and
cannot act itself). A peer that exits is usually noticed sooner: MLX's
ring backend raises "connection to a peer was lost" in the collective."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Optional


class Watchdog:
    def __init__(self, timeout: float, on_stall: Callable[[str], None]):
        self.timeout = timeout
        self.on_stall = on_stall
        self._since: Optional[float] = None
        self._what = ""
        self._thread: Optional[threading.Thread] = None

    @contextlib.contextmanager
    def watch(self, what: str):
        """Run the block under the timeout."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mlxmtp-dist-watchdog", daemon=True)
            self._thread.start()
        self._what, self._since = what, time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def alive(self) -> None:
        """The watched block made progress (one of many forwards it runs, as in the start-up
        calibration): its silence counts from now."""
        if self._since is not None:
            self._since = time.monotonic()

    def _run(self) -> None:
        while True:
            time.sleep(min(0.5, self.timeout / 4))
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout:
                self.on_stall(f"no answer from the other ranks for {self.timeout:g}s during {self._what} "
                              "(a rank died or stalled)")
                return
