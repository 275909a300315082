"""bench/simulated_device.py: the engine and its depth policy read the simulated device's
clock, not this machine's, and the clock is theirs again afterwards."""

import math
import statistics
import time

import pytest
from test_bench_decode import _bench_module

from mlxmtp.engine import timing
from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.generate import stream_generate
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.models.demo import demo_model_path
from mlxmtp.models.load import load


@pytest.fixture(scope="module")
def sim():
    return _bench_module("simulated_device")


def test_a_cycle_costs_its_verify_and_the_heads_steps(sim):
    clock = sim.DeviceClock(sim.DEVICES["h100"], noise=0.0, seed=0)
    plain = clock.cycle(0, 0, False)
    assert clock.cycle(3, 3, False) / plain == pytest.approx(1.82 + 3 * 0.375)
    assert clock.cycle(3, 3, True) / plain == pytest.approx(1.82 + 4 * 0.375)  # the head catches up
    assert clock.cycle(16, 0, False) / plain == pytest.approx(2.02 + 0.15 * 12)  # a suffix cycle, no head


def test_the_apple_estimate_prices_drafting_cheap_as_documented(sim):
    """`apple-27b-estimate`: a k = 3 cycle at 1.36 plain cycles (MTPLX's reported 2.24x at ~3
    tokens a cycle), a 33-token suffix verify under three."""
    clock = sim.DeviceClock(sim.DEVICES["apple-27b-estimate"], noise=0.0, seed=0)
    plain = clock.cycle(0, 0, False)
    assert clock.cycle(3, 3, False) / plain == pytest.approx(1.36)
    assert clock.cycle(32, 0, False) / plain == pytest.approx(1.24 + 28 * 0.06)


def test_the_calibration_is_as_noisy_as_the_engines_not_one_cycle(sim):
    """The engine's calibration takes medians over its rounds (engine/policy/calibration.py): the
    simulated one too, so its priors are no noisier than a device's would be."""
    clock = sim.DeviceClock(sim.DEVICES["h100"], noise=0.1, seed=0)
    true = math.log(clock.cycle(3, 3, False, 0.0) / clock.cycle(0, 0, False, 0.0))
    calibrated = [clock.calibration(None, 1, 4, False, kinds=("greedy",))["greedy"] for _ in range(200)]
    single = [math.log(clock.cycle(3, 3, False) / clock.cycle(0, 0, False)) - true for _ in range(200)]
    error = statistics.median(abs(math.log(c[3] / c[0]) - true) for c in calibrated)
    assert error < 0.6 * statistics.median(map(abs, single))


def test_the_depth_policy_learns_the_devices_costs_not_this_machines(sim):
    """On this CPU a demo cycle of depth 3 costs about twice a plain one; on the simulated
    H100 2.95 times: the policy's table after a request must say the latter."""
    model, tok = load(str(demo_model_path()))
    clock = sim.DeviceClock(sim.DEVICES["h100"], noise=0.0, seed=0)
    with sim.simulated(clock):
        engine = BatchGenerator(model, tok, EngineConfig())
        engine.calibrate(1)
        prompt = tok.encode("def main(argv):\n    ")
        params = SamplingParams(temperature=0.0)
        for _ in stream_generate(model, tok, prompt, max_tokens=40, engine=engine, params=params):
            pass
    costs = engine.policy.relative_costs(1, None, [0, 1, 2, 3, 4])
    want = [clock.cycle(k, k, False) / clock.cycle(0, 0, False) for k in range(5)]
    assert [costs[k] / costs[0] for k in range(5)] == pytest.approx(want, rel=0.02)
    assert clock.decode_seconds > 0
    assert timing.time is time  # the engine's own clock again


def test_the_agents_workload_is_bench_batch_s_code_prompts_and_tasks_in_turn(sim):
    """`--workload agents`: bench/batch.py's prompts, a code prompt and an edit or rename task
    on a held-out file in turn (several agents at once, on the device's costs)."""
    _, tok = load(str(demo_model_path()))
    prompts = sim.prompts_of(None, tok, "agents", 50)
    assert len(prompts) == 8
    assert all(len(p) < 40 for p in prompts[::2]) and all(len(p) > 100 for p in prompts[1::2])


def test_each_requests_wait_is_kept_in_the_order_of_its_prompt(sim):
    """Several requests at once: the bench compares each request's wait for its answer with
    MTP off's (the request worst off by suffix drafts for others' rows shows there). Two
    prompts decoded plainly to the same length finish in the same cycle."""
    model, tok = load(str(demo_model_path()))
    args = type("Args", (), dict(noise=0.0, calibration_noise=None, rounds=1, concurrency=2, max_tokens=6, loop=1))()
    prompts = [tok.encode("def main(argv):\n    "), tok.encode("class Stack:\n    def __init__(self):\n")]
    rates, _, waits = sim.run_setting(model, tok, sim.DEVICES["h100"], 0, False, prompts, args, 0.0, 0)
    assert len(waits) == 1 and len(waits[0]) == 2 and rates[0] > 0
    assert waits[0][0] == pytest.approx(waits[0][1]) and waits[0][0] > 0


def test_a_round_drafts_nothing_from_an_earlier_rounds_answer(sim):
    """Rounds ask the same prompts again (the agents workload has eight): a greedy answer would
    be drafted whole from the index of earlier outputs, where each agent's request is new. So each
    round starts with that index empty, and a prompt asked again decodes as it did the first time."""
    model, tok = load(str(demo_model_path()))
    args = type("Args", (), dict(noise=0.0, calibration_noise=None, rounds=2, concurrency=1, max_tokens=40,
                                 loop=1))()
    prompts = [tok.encode("class Stack:\n    def __init__(self):\n")]
    _, _, waits = sim.run_setting(model, tok, sim.DEVICES["h100"], 3, True, prompts, args, 0.0, 0)
    assert waits[1][0] == pytest.approx(waits[0][0], rel=0.05)


def test_a_loop_sends_each_slots_next_request_when_its_last_is_answered(sim):
    """`--loop`: requests `concurrency` at a time, each answer followed by the next request (agents
    waiting on their answers); each one's wait counts from its submission."""
    model, tok = load(str(demo_model_path()))
    prompts = [tok.encode("def main(argv):\n    "), tok.encode("class Stack:\n    def __init__(self):\n")]
    clock = sim.DeviceClock(sim.DEVICES["h100"], noise=0.0, seed=0)
    with sim.simulated(clock):
        engine = BatchGenerator(model, tok, EngineConfig(enable_mtp=False))
        waits = {}
        for slots in (1, 2):
            waits[slots] = []
            rate = sim.decode_rate(engine, clock, prompts, 6, 0.0, 0, sim.Counter(), waits[slots], slots)
            cycles = 10 if slots == 1 else 5  # 5 plain cycles a request after its prefill's token
            assert rate * clock.device["plain_seconds"] == pytest.approx(10 / cycles)
    assert waits[1] == pytest.approx(waits[2])  # one at a time: each waits as long as in a batch


def test_by_kind_says_where_a_settings_cost_went(sim, capsys):
    """`--by-kind`: each setting's cycles by kind and batch size, their cost in plain cycles and
    tokens per cost; MTP off decoding two rows makes two tokens per plain cycle's cost."""
    model, tok = load(str(demo_model_path()))
    args = type("Args", (), dict(noise=0.0, calibration_noise=None, rounds=1, concurrency=2, max_tokens=6,
                                 loop=1, by_kind=True))()
    prompts = [tok.encode("def main(argv):\n    "), tok.encode("class Stack:\n    def __init__(self):\n")]
    sim.run_setting(model, tok, sim.DEVICES["h100"], 0, False, prompts, args, 0.0, 0)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].strip().startswith("MTP off: cycles by kind")
    rows, _, kind, cycles, cost, per_cost = lines[1].split()  # "2 rows  plain  5  5.0  2.00"
    assert (rows, kind, int(cycles)) == ("2", "plain", 5) and float(cost) == pytest.approx(5.0)
    assert float(per_cost) == pytest.approx(2.0) and len(lines) == 2


def test_adaptive_is_judged_over_several_seeds(sim, capsys):
    """A run's standing moves with the noise's draws (the policy's choices follow them):
    `--seed 0,1,2` reports each run, then adaptive's mean and lowest over the best fixed
    setting and the request worst off in any of them."""
    args = type("Args", (), dict(device="h100", workload="agents", concurrency=2, noise=0.1, rounds=2,
                                 suffix=True, loop=1))()

    def results(rates, waits):  # MTP off, k = 3 twice its rate, and adaptive (rates, depths, waits)
        return {0: ([1.0, 1.0], {}, [[2.0, 2.0], [2.0, 2.0]]), 3: ([2.0, 2.0], {}, [[1.0, 1.0], [1.0, 1.0]]),
                "adaptive": (rates, {"k=3": 5}, waits)}

    a = sim.report(args, 0.0, 0, [0, 3, "adaptive"], results([2.2, 1.8], [[1.0, 4.0], [1.0, 1.0]]))
    b = sim.report(args, 0.0, 1, [0, 3, "adaptive"], results([1.6, 1.6], [[2.0, 1.0], [1.0, 1.0]]))
    assert a["of_best"] == pytest.approx(1.0) and b["of_best"] == pytest.approx(0.8)
    assert a["worst_wait"] == pytest.approx(0.5)  # MTP off's 2.0 over adaptive's 4.0
    assert b["mean_wait"] == pytest.approx(1.75)
    sim.over_seeds(0.0, [0, 1], [a, b])
    out = capsys.readouterr().out
    assert "seed=1" in out and "adaptive / best fixed mean 0.900, lowest 0.800" in out
    assert "mean 1.688x, worst 0.500x" in out
