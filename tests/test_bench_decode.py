"""bench/decode.py: the interleaved timing it reports, and one tiny end-to-end run."""

import importlib.util
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def decode():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_decode", BENCH / "decode.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(BENCH))


class _Clock:
    """Stands in for an engine: records the time it is told to leave out."""

    def __init__(self):
        self.skipped = 0.0

    def skip_time(self, seconds):
        self.skipped += seconds


def _sleeper(n, per_token, step=1):
    for _ in range(0, n, step):
        time.sleep(per_token * step)
        yield step
    yield None


def test_interleaved_times_each_side_on_its_own_turns(decode):
    clock = _Clock()
    # A side twice as fast per token, producing 3 tokens a step (a drafting engine), beside
    # a plain one: each side's rate is its own, whatever the other costs.
    fast, slow = decode.interleaved([(_sleeper(48, 0.002, 3), clock), (_sleeper(40, 0.004), None)], chunk=8)
    assert fast["first"] == 3 and slow["first"] == 1  # prefill / first step: not timed
    assert fast["tokens"] == 45 and slow["tokens"] == 39
    assert fast["done"] and slow["done"]
    assert 300 < fast["tps"] <= 500 and 150 < slow["tps"] <= 250
    assert fast["tps"] / slow["tps"] == pytest.approx(2.0, rel=0.3)
    # The engine is told about all the other side's time, first turn included.
    assert clock.skipped >= slow["seconds"] and clock.skipped == pytest.approx(slow["seconds"] + 0.004, abs=0.01)


@pytest.mark.slow
def test_benchmark_runs_end_to_end_on_the_demo_model(decode, capsys):
    path = str(decode.demo_model_path())
    decode.bench_model("demo", path, temps=[0.0], depths=[1], rounds=1, max_tokens=12, markdown=True)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ml")]
    assert [r.split(" | ")[0].split(" (")[0] for r in rows] == [
        "| mlx-lm generate", "| mlxmtp MTP off", "| mlxmtp k=1", "| mlxmtp adaptive"]
    assert "(depths used: " in rows[-1]
    k1 = rows[2].split(" | ")
    assert float(k1[2].rstrip("x")) > 0 and 0.0 <= float(k1[4]) <= 1.0  # speedup, acceptance
