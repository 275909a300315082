"""Bounded shutdown for `mlxmtp serve`: one request never holds the server hostage.

uvicorn's own graceful shutdown (installed 0.5x) on SIGTERM / a first SIGINT: stop
listening, close idle keep-alive connections, mark busy ones to close after their
response, then wait for every open connection to finish, with no limit by default.
A stream with `max_tokens` in the thousands would keep the process alive for minutes,
and a second SIGINT (`force_exit`) only skips the wait, cutting streams mid-event.

`GracefulServer` keeps uvicorn's first half and bounds the wait: `shutdown_timeout`
seconds after the first signal it ends every request still open with
`EngineBridge.abort_all`, so each stream closes with its API's own final error event
(OpenAI: `data: {"error": ...}` then `data: [DONE]`; Anthropic: `event: error`)
rather than a truncated body, the connections close, and `run` returns normally (exit
code 0). A second SIGTERM / SIGINT exits at once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import uvicorn
from uvicorn.config import STARTUP_FAILURE

log = logging.getLogger("mlxmtp.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, bridge, shutdown_timeout: float):
        # Backstop: should a stream ignore the abort (e.g. a handler that submitted just
        # after it; see _abort_loop), uvicorn cancels the remaining tasks a little later.
        config.timeout_graceful_shutdown = shutdown_timeout + 1.5
        super().__init__(config)
        self.bridge = bridge
        self.shutdown_timeout = shutdown_timeout
        self._signalled = False

    def handle_exit(self, sig, frame) -> None:
        # Replaces uvicorn's handler, which also records the signal to raise it again once
        # serving returns (the process would then die by SIGTERM, not exit 0), and which
        # needs a second SIGINT, not SIGTERM, to stop waiting.
        if self._signalled:
            # Runs in the main thread between bytecodes: os._exit skips the lifespan
            # shutdown and interpreter teardown, which may wait on the engine thread.
            sys.stderr.write("mlxmtp: second signal, exiting now\n")
            sys.stderr.flush()
            os._exit(128 + int(sig))
        self._signalled = True
        self.should_exit = True  # uvicorn's main loop notices within 0.1 s and starts shutdown()
        log.info("shutting down: open streams get %gs to finish (signal again to exit now)", self.shutdown_timeout)
        # A thread, not loop.call_later: a signal handler should not touch the loop, and
        # abort_all is thread-safe (events reach the loop through call_soon_threadsafe).
        threading.Thread(target=self._abort_loop, name="mlxmtp-shutdown", daemon=True).start()

    def _abort_loop(self) -> None:
        time.sleep(self.shutdown_timeout)
        msg = f"the server is shutting down; the request was still running after {self.shutdown_timeout:g}s"
        # Repeat until the process exits: a handler that was between reading its body and
        # submitting when the first abort ran gets the same clean ending.
        while True:
            n = self.bridge.abort_all(msg)
            if n:
                log.warning("shutdown timeout: ended %d open request(s) with an error", n)
            time.sleep(0.25)


def run_server(app, *, host: str, port: int, log_level: str, shutdown_timeout: float) -> None:
    """Serve `app` (from create_app) until a signal, then exit 0 after a clean, bounded
    shutdown (the streams are ended and the engine thread is stopped by then)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level)
    server = GracefulServer(config, app.state.server.bridge, shutdown_timeout)
    try:
        server.run()
        code = 0 if server.started else STARTUP_FAILURE  # as uvicorn.run
    except SystemExit as e:  # uvicorn's own startup failure: the address could not be bound
        code = e.code if isinstance(e.code, int) else STARTUP_FAILURE
    # Exit without the interpreter's teardown: MLX's native threads and static objects
    # are destroyed then, and an engine thread still inside an MLX call at that moment
    # aborts the process ("terminate called without an active exception", exit -6).
    # That holds too when serving never started, after the lifespan had started the engine.
    if code:
        app.state.server.bridge.stop()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
