"""Which cycles engine/timing.CycleClock reports to the depth policy as timed: a cycle's cost is
only comparable with its neighbours' where nothing but its depth differs, so the first cycle of
another kind (a switch between plain decoding and drafting) and a cycle in which the head caught
up on a plain stretch's inputs are not timed."""

from types import SimpleNamespace

import pytest

from mlxmtp.engine import timing


class Recorder:
    """Stands in for the depth policy: keeps (depth, seconds, switch seconds) of each report."""

    def __init__(self):
        self.reports = []

    def update(self, k, batch_size, seconds, kept_per_row, classes=None, switch_seconds=None, head=True,
               requests=None, chances=None):
        self.reports.append((k, seconds, switch_seconds))

    def learn_head_rows(self, *args, **kwargs):
        pass


def _row(i):
    stats = SimpleNamespace(decode_seconds=0.0, device_seconds=0.0, overhead_seconds=0.0, draft_seconds=0.0)
    sampler = SimpleNamespace(params=SimpleNamespace(greedy=True), reproducible=False)
    return SimpleNamespace(req=SimpleNamespace(id=i), sampler=sampler, generated=40, stats=stats)


class Run:
    """Feeds CycleClock one cycle at a time on a clock that advances by each cycle's seconds."""

    def __init__(self, monkeypatch):
        self.now, self.clock, self.policy, self.rows = 0.0, timing.CycleClock(), Recorder(), [_row(0), _row(1)]
        monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: self.now))

    def cycle(self, k, seconds, synchronous=True, drafted=None, switched=False):
        """One cycle of depth k, `drafted`: (source, drafts) per row (the head's k by default)."""
        self.clock.switched = switched
        if drafted is None:
            drafted = [("mtp", k)] * len(self.rows) if k else []
        rec = SimpleNamespace(rows=self.rows, k=k, t0=self.now, synchronous=synchronous, computed=0.0, built=0.0,
                              drafted=drafted)
        self.now += seconds
        self.clock.finish(rec, self.policy, [1] * len(self.rows))
        return self.policy.reports[-1]


@pytest.mark.parametrize("synchronous", [True, False])
def test_the_first_cycle_of_another_kind_is_not_timed(monkeypatch, synchronous):
    """Plain and drafting cycles that are both synchronous (a row's logits processor needs its
    tokens on the host) or both pipelined (`pipeline_drafts`): the switch cycle reports its
    seconds as the switch's only, and the first plain cycle after drafting is not timed."""
    run = Run(monkeypatch)
    run.cycle(0, 1.0, synchronous)
    assert run.cycle(0, 1.0, synchronous)[1] == pytest.approx(1.0)
    assert run.cycle(1, 2.5, synchronous, switched=True) == (1, None, pytest.approx(2.5))
    assert run.cycle(1, 2.0, synchronous)[1] == pytest.approx(2.0)
    assert run.cycle(0, 1.3, synchronous)[1] is None
    assert run.cycle(0, 1.0, synchronous)[1] == pytest.approx(1.0)


def test_a_suffix_cycle_whose_head_rows_caught_up_after_plain_decoding_is_not_timed(monkeypatch):
    """A suffix cycle right after plain decoding prices its verify unless its head rows first
    caught up on the plain stretch's inputs; one without head rows, or not after a switch, does."""
    run = Run(monkeypatch)
    mixed, suffix_only = [("suffix", 1), ("mtp", 1)], [("suffix", 8), ("mtp", 0)]
    run.cycle(0, 1.0, synchronous=False)
    assert run.cycle(1, 2.3, drafted=mixed, switched=True)[1] is None
    assert run.cycle(1, 1.9, drafted=mixed)[1] == pytest.approx(1.9)
    run.cycle(0, 1.0, synchronous=False)
    assert run.cycle(8, 3.0, drafted=suffix_only, switched=True)[1] == pytest.approx(3.0)
