"""The async bridge: one engine thread, per-request asyncio queues.

The engine (engine/interface.Engine: a `BatchGenerator`, or rank 0's driver of a
distributed run) is single-threaded (only `submit` / `cancel` are thread-safe), so one
daemon thread owns it and loops `step()`; each event goes to its request's asyncio
queue through `loop.call_soon_threadsafe`. When there is no work the thread sleeps on
a threading.Event that `submit` sets.

If `step()` raises, the requests the failed step was working on (the decoding batch
and a prefill in progress) get an error event, the engine is rebuilt (its caches may
be half-updated) and requests that had not started yet are resubmitted to it: one bad
step never takes the server down.

MLX streams are per thread: a graph recorded on one thread's stream cannot be evaluated
on another ("There is no Stream(cpu, 0) in current thread"). So the engine is built on
the engine thread, and `create_app` evaluates the weights (including the MTP head's,
which `mx.load` leaves lazy) before any thread touches them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from ..distributed.engine import EXIT_CODE
from ..engine.interface import Engine
from ..engine.request import Event, Request

log = logging.getLogger("mlxmtp.server")
STOP_WAIT = 5.0  # seconds a stopping server waits for the engine thread's step to end
# Seconds it waits beyond that for the prefix cache to be written to disk (a few GB of a
# large model's states take seconds; an unfinished file is never used: see engine/prefix/disk.py).
SAVE_TIMEOUT = 300.0
STARTING_LOG = 30.0  # seconds between the lines saying the engine is still starting


class EngineBridge:
    def __init__(self, make_engine: Callable[[], Engine], metrics=None):
        self._make_engine = make_engine
        self.engine: Optional[Engine] = None  # built on the engine thread
        self._ready = threading.Event()
        self._start_error: Optional[BaseException] = None
        self.metrics = metrics
        self._queues: Dict[int, Tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._requests: Dict[int, Request] = {}
        self._lock = threading.Lock()  # guards _queues/_requests and engine swaps vs submit
        self._wake = threading.Event()
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self.restarts = 0

    # ------------------------------------------------------------------ any thread
    def start(self, timeout: Optional[float] = None) -> None:
        """Start the engine thread and wait until it serves: its first forwards page a large
        model's weights in and its cost calibration runs them dozens of times, which can
        take minutes on a cold disk or a busy machine, so by default it is waited for as
        long as the thread lives (a line every STARTING_LOG seconds), not for a fixed time."""
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._main, name="mlxmtp-engine", daemon=True)
            self._thread.start()
            t0 = time.monotonic()
            while not self._ready.wait(STARTING_LOG if timeout is None else timeout):
                if timeout is not None or not self._thread.is_alive():
                    raise RuntimeError("the engine thread did not start")
                log.info("the engine is still starting (%.0f s): first forwards and cost calibration",
                         time.monotonic() - t0)
            if self._start_error is not None:
                raise RuntimeError(f"could not build the engine: {self._start_error}") from self._start_error

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_WAIT)
            # An engine with a prefix cache on disk writes it once its step ends: wait for that
            # too (an unfinished file is never used, but its state would be lost).
            if self._thread.is_alive() and self._prefix_disk() is not None:
                log.info("writing the prefix cache to disk before exiting")
                self._thread.join(timeout=SAVE_TIMEOUT)
            self._thread = None

    def submit(self, req: Request) -> asyncio.Queue:
        """Queue a request from the event loop; raises ValueError on bad input."""
        if self.engine is None:
            raise RuntimeError("the engine is not running")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self.engine.submit(req)
            self._queues[req.id] = (loop, q)
            self._requests[req.id] = req
        self._wake.set()
        return q

    def cancel(self, request_id: int) -> None:
        with self._lock:
            if request_id in self._queues and self.engine is not None:
                self.engine.cancel(request_id)
        self._wake.set()

    def abort_all(self, message: str) -> int:
        """End every open request with an error event carrying `message` (a shutdown that
        ran out of time): each stream then closes with its API's final error event.
        Returns how many requests were ended."""
        with self._lock:
            ids = list(self._queues)
            if self.engine is not None:
                for rid in ids:
                    self.engine.cancel(rid)
        for rid in ids:
            self._dispatch(Event(rid, [], "", "error", error=message))
        self._wake.set()
        return len(ids)

    def fail_and_exit(self, message: str) -> None:
        """The engine cannot go on (a distributed engine lost a rank): end every open
        request with an error naming the cause, give the streams a moment to send it,
        and exit non-zero (a supervisor restarts the whole group)."""
        n = self.abort_all(f"the distributed engine failed: {message}")
        log.error("distributed engine failed (%s); ended %d open request(s); exiting", message, n)
        time.sleep(1.0)
        logging.shutdown()
        os._exit(EXIT_CODE)

    @property
    def num_active(self) -> int:
        return self.engine.num_active if self.engine is not None else 0

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting if self.engine is not None else 0

    @property
    def num_open(self) -> int:
        """Requests submitted and not finished (server side view)."""
        with self._lock:
            return len(self._queues)

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        try:
            self.engine = self._make_engine()
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._start_error = e
            self._ready.set()
            return
        self.engine.set_fatal_handler(self.fail_and_exit)  # a distributed engine cannot be rebuilt alone
        try:
            self.engine.calibrate(1)  # before serving: the first request does not wait for it
        except Exception:  # noqa: BLE001 - the engine still runs; it calibrates on first use
            log.exception("cost calibration at start-up failed")
        self._ready.set()
        self._run()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._save_prefix_cache()
            self.engine.close()  # a distributed engine tells its other ranks

    def _prefix_disk(self):
        """The engine's prefix cache's disk store (engine/prefix/disk.py), or None."""
        return self.engine.prefix_cache.disk if self.engine is not None else None

    def _save_prefix_cache(self) -> None:
        """Write what the prefix cache holds to its disk store, if it has one (a restarted
        server then starts from those states)."""
        if self._prefix_disk() is None:
            return
        try:
            self.engine.prefix_cache.save_to_disk()
        except Exception:  # noqa: BLE001 - stopping must not fail for it
            log.exception("could not write the prefix cache to disk")

    def _loop(self) -> None:
        while not self._stop:
            eng = self.engine
            # Clear before checking: a submit after the check sets it again, so no lost wake-up.
            self._wake.clear()
            if not eng.has_work:
                self._wake.wait(timeout=1.0)
                continue
            cycles = eng.cycles
            try:
                events = eng.step()
            except Exception as e:  # noqa: BLE001 - any failure must not kill the thread
                log.exception("engine step failed")
                if self.metrics is not None:
                    self.metrics.engine_errors.inc()
                self._recover(eng, e)
                continue
            for ev in events:
                self._dispatch(ev)
            if self.metrics is not None:
                try:
                    self.metrics.on_step(eng, eng.cycles != cycles)
                except Exception:  # noqa: BLE001 - metrics must never stop generation
                    log.exception("metrics update failed")

    def _dispatch(self, ev: Event) -> None:
        if ev.finish_reason is not None and ev.stats is not None and self.metrics is not None:
            # Counted here, not by the listener: a request whose client left has none.
            try:
                self.metrics.on_finish(ev.stats)
            except Exception:  # noqa: BLE001 - metrics must never stop generation
                log.exception("metrics update failed")
        with self._lock:
            if ev.finish_reason is not None:
                entry = self._queues.pop(ev.request_id, None)
                self._requests.pop(ev.request_id, None)
            else:
                entry = self._queues.get(ev.request_id)
        if entry is None:
            return
        loop, q = entry
        try:
            loop.call_soon_threadsafe(q.put_nowait, ev)
        except RuntimeError:  # the loop is closed (server shutting down)
            pass

    def _recover(self, eng: Engine, exc: Exception) -> None:
        # The step may have failed half-way through moving a row (e.g. a prefill that had
        # just left `waiting`), so "touched" is everything except what provably had not
        # started: still in the inbox, or waiting with no prefill state yet.
        untouched = set(eng.unstarted_request_ids())
        cancelled = set(eng.cancelled_ids())
        self._save_prefix_cache()  # its entries are copies no step touches: the new engine reads them
        with self._lock:
            try:
                self.engine = self._make_engine()
            except Exception:  # noqa: BLE001
                log.exception("could not rebuild the engine")
                untouched = set()
            self.restarts += 1
            keep = [r for rid, r in self._requests.items() if rid in untouched and rid not in cancelled]
            failed = [rid for rid in self._requests if rid not in {r.id for r in keep}]
            for req in keep:
                self.engine.submit(req)
        msg = f"generation failed: {type(exc).__name__}: {exc}"
        for rid in failed:
            self._dispatch(Event(rid, [], "", "error", error=msg))
        log.warning("engine rebuilt after an error; failed %d request(s), resubmitted %d", len(failed), len(keep))
