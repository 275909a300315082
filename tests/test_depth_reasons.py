"""Every cycle's depth comes with the reason it was chosen, in the request's stats."""

from engine_helpers import loaded, prompt_of

from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.generate import generate
from mlxmtp.engine.policy import adaptive
from mlxmtp.engine.sampling.params import SamplingParams

KNOWN = {adaptive.FIXED, adaptive.NO_ROOM, adaptive.CALIBRATING, adaptive.PROBE, adaptive.BEST, adaptive.HOLDING,
         adaptive.LEARNING, adaptive.UNSURE}


def test_reasons_cover_every_cycle(fixture_model):
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    adaptive_run = generate(model, tok, prompt_of(12, seed=1), max_tokens=40).stats.as_dict()
    reasons = adaptive_run["depth_reasons"]
    assert set(reasons) <= KNOWN and sum(reasons.values()) >= adaptive_run["forwards"]
    pinned = generate(model, tok, prompt_of(12, seed=1), max_tokens=20,
                      config=EngineConfig(num_draft=2)).stats.as_dict()
    assert set(pinned["depth_reasons"]) == {adaptive.FIXED}
    off = generate(model, tok, prompt_of(12, seed=1), max_tokens=5, config=EngineConfig(enable_mtp=False),
                   params=SamplingParams()).stats.as_dict()
    assert set(off["depth_reasons"]) == {"no MTP head"}


def test_metrics_count_cycles_by_depth_and_reason():
    from types import SimpleNamespace

    from mlxmtp.server.metrics import Metrics

    m = Metrics()
    m.on_step(SimpleNamespace(num_waiting=0, num_active=1, last_depth=3, why=adaptive.BEST), True)
    text = m.render().decode()
    assert 'mlxmtp_mtp_depth_decisions_total{depth="3",reason="best expected rate"} 1.0' in text
