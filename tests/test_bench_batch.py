"""bench/batch.py: requests all at once, or with `--loop` a slot's next request sent when its
last is answered."""

import pytest
from test_bench_decode import _bench_module

from mlxmtp.models.demo import demo_model_path
from mlxmtp.models.load import load


@pytest.fixture(scope="module")
def batch():
    return _bench_module("batch")


def test_a_loop_keeps_one_request_a_slot_in_flight(batch):
    """Two slots, two requests each: never more than two decode at once, and all four answer."""
    model, tok = load(str(demo_model_path()))
    looped = batch.run(model, tok, 2, 6, False, loop=2)
    at_once = batch.run(model, tok, 4, 6, False)
    assert looped["mean_batch"] <= 2 < at_once["mean_batch"]
    assert looped["answered"] == at_once["answered"] == 4 and looped["agg_tps"] > 0
