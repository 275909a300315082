"""The server's engine thread starts however long the engine takes to be ready."""

import logging
import time
import types

import pytest

from mlxmtp.server import engine_thread
from mlxmtp.server.engine_thread import EngineBridge


class SlowEngine:
    """An engine whose calibration takes `seconds` (a large model paging its weights in);
    of engine/interface.Engine, what starting and stopping call."""

    def __init__(self, seconds: float, fail: BaseException = None):
        self.seconds, self.fail = seconds, fail
        self.has_work = False
        self.prefix_cache = types.SimpleNamespace(disk=None)

    def set_fatal_handler(self, handler):
        pass

    def close(self):
        pass

    def calibrate(self, batch_size):
        time.sleep(self.seconds)
        if self.fail is not None:
            raise self.fail


def test_a_slow_start_is_waited_for_and_said(monkeypatch, caplog):
    monkeypatch.setattr(engine_thread, "STARTING_LOG", 0.05)
    bridge = EngineBridge(lambda: SlowEngine(0.4))
    bridge._loop = lambda: None  # no requests: only the start is under test
    with caplog.at_level(logging.INFO, logger="mlxmtp.server"):
        bridge.start()
    assert bridge.engine is not None
    assert any("still starting" in r.message for r in caplog.records)
    bridge.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_that_dies_while_starting_is_an_error(monkeypatch):
    monkeypatch.setattr(engine_thread, "STARTING_LOG", 0.05)
    bridge = EngineBridge(lambda: SlowEngine(0.1, fail=SystemExit(1)))  # not an Exception: not caught
    with pytest.raises(RuntimeError, match="did not start"):
        bridge.start()
