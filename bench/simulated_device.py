"""The real engine and depth policy on the demo, timed by a GPU's measured cycle costs.

No GPU is at hand for most runs, and the depth policy's choices depend on what cycles cost
on the machine it runs on: on an H100 the demo's k = 1 cycle costs 1.91 plain cycles and
k = 3 2.95 (BENCHMARKS.md, "Where a cycle's time goes"), where on this CPU k = 3 costs
about 2. bench/policy_sim.py and tests/test_adaptive.simulate drive the policy object
alone with drawn acceptance; here the whole engine decodes the demo for real (its own
drafts and acceptance, the start-up calibration, each request's learning, probes, suffix
cycles), and only the clock is simulated: every cycle advances a virtual clock by what a
cycle of its kind costs on the device (`DEVICES`), times lognormal noise, and the engine
and its policy read that clock instead of this machine's. The calibration at start-up
draws the same costs, in rounds, and takes their medians as the engine's does. Throughput
is decode tokens (the prefill's first token left out) per virtual second, so settings
compare on the device's costs with the text this machine decodes; with several requests
at once, also each request's wait for its answer against MTP off's (the mean, and the
request worst off). One engine serves every round, as a server would, but each round starts
with its index of finished outputs empty (`forget_outputs`): the rounds ask the same few
prompts again. `--loop N` sends each round's requests `--concurrency` at a time, each answer
followed by the next request, as agents waiting on their answers do. `--warm` starts the
adaptive engine from what an earlier run kept on disk (engine/policy/saved.py), as a server
restarted on the same machine does.

A cycle of depth k costs verify(k + 1) + k * head_step plain cycles, plus one head step for
the first drafting cycle after plain decoding (the head's catch-up); a suffix cycle of
depth K costs verify(K + 1) plus the head steps its head rows chained. Verify costs past
the measured lengths grow by `per_token` a token (a guess, marked as such below); batch
size is taken not to change them (the demo is launch-bound on a GPU). `--device
apple-27b-estimate` is not a measurement: a large model's costs on an Apple GPU as bandwidth
and reported speed-ups suggest (`DEVICES`), where drafting is cheap.

    python bench/simulated_device.py                          # H100, greedy and 0.6, code
    python bench/simulated_device.py --temps 0 --rounds 6 --noise 0.05
    python bench/simulated_device.py --suffix --workload repeat
    python bench/simulated_device.py --suffix --workload edit --depths 3 --max-tokens 200
    python bench/simulated_device.py --suffix --workload agents --concurrency 4 --depths 3 --rounds 3
    python bench/simulated_device.py --suffix --workload agents --concurrency 8 --depths 3 --seed 0,1,2
    python bench/simulated_device.py --suffix --workload agents --concurrency 8 --depths 3 --by-kind
    python bench/simulated_device.py --suffix --workload agents --concurrency 4 --loop 2 --depths 3
    python bench/simulated_device.py --device apple-27b-estimate --depths 3,4 --seed 0,1
    python bench/simulated_device.py --device apple-27b-estimate --workload agents --concurrency 4 --depths 3,4 --warm
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx_lm  # noqa: E402
from batch import prompts_of  # noqa: E402
from decode import workload_prompts  # noqa: E402

from mlxmtp.engine import batch as batch_module  # noqa: E402
from mlxmtp.engine import cycle as cycle_module  # noqa: E402
from mlxmtp.engine import timing  # noqa: E402
from mlxmtp.engine.batch import BatchGenerator  # noqa: E402
from mlxmtp.engine.config import EngineConfig  # noqa: E402
from mlxmtp.engine.policy import calibration  # noqa: E402
from mlxmtp.engine.request import Request  # noqa: E402
from mlxmtp.engine.sampling.params import SamplingParams  # noqa: E402
from mlxmtp.models.demo import demo_model_path  # noqa: E402
from mlxmtp.models.load import load  # noqa: E402

# Per device: a verify forward of T tokens against a 1-token forward (measured up to T = 5),
# the head's step and a plain cycle's seconds. H100: bench/decode.py's forward costs (T = 2..5:
# 1.54, 1.74, 1.82, 2.02) and bench/cycle_profile.py's cycles (2.94, 5.62, 7.29, 8.68, 10.39 ms
# at k = 0..4: each draft adds 0.37-0.38 plain cycles beyond its verify). `per_token`, what each
# token past T = 5 adds to a verify (suffix cycles of 8-32 drafts), is a guess: the slope from
# T = 4 to 5 was 0.20, and a longer verify fills the device better.
# apple-27b-estimate: not measured, an estimate of a large model on an Apple GPU, where
# decoding is bandwidth-bound: a 4-bit 27B model reads ~15 GB a step, and each token more in a
# verify adds its compute, ~6% of a step; the head (one decoder layer and the lm_head) reads ~6%
# of the model's weights. So a k = 3 cycle costs 1.18 + 3 x 0.06 = 1.36 plain
# cycles, as MTPLX's reported 28 -> 63 tok/s at depth 3 on an M5 Max implies (2.24x at ~3 tokens
# a cycle); a plain step of 28 tok/s. A check of the policy where drafting is cheap, not a
# forecast of speed.
DEVICES = {
    "h100": dict(verify={1: 1.0, 2: 1.54, 3: 1.74, 4: 1.82, 5: 2.02}, per_token=0.15, head_step=0.375,
                 plain_seconds=0.00294),
    "apple-27b-estimate": dict(verify={1: 1.0, 2: 1.06, 3: 1.12, 4: 1.18, 5: 1.24}, per_token=0.06,
                               head_step=0.06, plain_seconds=1 / 28),
}


class DeviceClock:
    """The virtual clock and what each cycle advances it by."""

    def __init__(self, device: dict, noise: float, seed: int, calibration_noise: Optional[float] = None,
                 by_kind: bool = False):
        self.device, self.noise, self.draw = device, noise, random.Random(seed)
        self.kinds = CycleKinds() if by_kind else None  # `--by-kind`
        # The start-up calibration's own noise: on a GPU its first cycles of each shape also
        # build graphs and compile kernels.
        self.calibration_noise = noise if calibration_noise is None else calibration_noise
        self.now = 0.0
        self.decode_seconds = 0.0

    def perf_counter(self) -> float:
        return self.now

    def verify(self, T: int) -> float:
        table = self.device["verify"]
        longest = max(table)
        return table[T] if T in table else table[longest] + self.device["per_token"] * (T - longest)

    def cycle(self, k: int, head_steps: int, switched: bool, noise: Optional[float] = None) -> float:
        """Seconds of one cycle of depth k whose head chained `head_steps` drafts."""
        plain = self.verify(k + 1) + (head_steps + (1 if switched and head_steps else 0)) * self.device["head_step"]
        sigma = self.noise if noise is None else noise
        return plain * self.device["plain_seconds"] * math.exp(self.draw.gauss(0.0, sigma))

    def advance(self, rec, switched: bool) -> float:
        """Advances the clock by cycle `rec`; returns its cost in plain cycles."""
        dt = self.cycle(rec.k, head_steps(rec), switched)
        self.now += dt
        self.decode_seconds += dt
        return dt / self.device["plain_seconds"]

    def calibration(self, pieces, batch_size, max_depth, shape_stable, pipelined=False, kinds=("greedy", "sampled"),
                    progress=None):
        """The start-up calibration's costs as it measures them: the mean of a run's cycles (as many
        as the engine's runs time together), its rounds and medians of ratios."""
        n = calibration.drafting_cycles(pipelined)

        def run(k: int, cycles: int):
            return lambda: sum(self.cycle(k, k, False, self.calibration_noise) for _ in range(cycles)) / cycles

        runs = {(kind, k): run(k, n if k else calibration.PLAIN_CYCLES) for kind in kinds for k in range(max_depth + 1)}
        seconds = calibration._interleaved(runs, progress)
        return {kind: {k: seconds[kind, k] for k in range(max_depth + 1)} for kind in kinds}


def head_steps(rec) -> int:
    """The drafts the head chained in cycle `rec` (its deepest row's; a cycle with no per-row
    sources is the head's own, of depth k)."""
    return max((n for source, n in rec.drafted if source == "mtp"), default=0) if rec.drafted else rec.k


class CycleKinds:
    """`--by-kind`: a setting's cycles by kind (plain, the head's, suffix cycles by the head's depth
    in them) and batch size, with their cost in plain cycles and the tokens they made: where its
    time went (a plain cycle makes a token a row for a cost of 1)."""

    def __init__(self):
        self.of: dict = {}  # (kind, rows) -> [cycles, cost, tokens]

    def add(self, rec, kept, cost: float) -> None:
        suffix = any(source == "suffix" for source, _ in rec.drafted)
        kind = "plain" if rec.k == 0 else f"suffix, head {head_steps(rec)}" if suffix else "head"
        tally = self.of.setdefault((kind, len(rec.rows)), [0, 0.0, 0])
        tally[0], tally[1], tally[2] = tally[0] + 1, tally[1] + cost, tally[2] + sum(kept) + len(kept)

    def show(self, label: str) -> None:
        print(f"  {label}: cycles by kind and rows (count, cost in plain cycles, tokens per cost)")
        for (kind, rows), (n, cost, tokens) in sorted(self.of.items(), key=lambda item: (item[0][1], item[0][0])):
            print(f"    {rows} rows  {kind:15s} {n:5d}  {cost:7.1f}  {tokens / cost:6.2f}")


@contextmanager
def simulated(clock: DeviceClock):
    """The engine's clocks and its calibration read `clock` inside the block."""
    fake_time = SimpleNamespace(perf_counter=clock.perf_counter)
    saved = (timing.time, cycle_module.time, batch_module.time, calibration.measure_cycle_costs,
             timing.CycleClock.finish)
    original_finish = timing.CycleClock.finish

    def finish(self, rec, policy, kept, *args, **kwargs):
        cost = clock.advance(rec, self.switched)
        if clock.kinds is not None:
            clock.kinds.add(rec, kept, cost)
        return original_finish(self, rec, policy, kept, *args, **kwargs)

    timing.time = cycle_module.time = batch_module.time = fake_time
    calibration.measure_cycle_costs = clock.calibration
    timing.CycleClock.finish = finish
    try:
        yield clock
    finally:
        (timing.time, cycle_module.time, batch_module.time, calibration.measure_cycle_costs,
         timing.CycleClock.finish) = saved


def _count(counts: Counter, stats) -> None:
    """Add a finished request's cycles by depth ("k=2") and by the policy's reason to `counts`."""
    if stats is not None:
        counts.update({f"k={k}": n for k, n in stats.depths.items()})
        counts.update(stats.depth_reasons)


def decode_rate(engine, clock: DeviceClock, prompts, max_tokens: int, temp: float, seed: int,
                depths: Counter, waits: list, slots: Optional[int] = None) -> float:
    """Decode tokens per virtual second of `prompts` submitted together to `engine` (one, or a
    batch), or `slots` at a time, each finished request followed by the next (`--loop`); each
    request's cycles' depths added to `depths`, the virtual seconds from its submission until it
    finished to `waits`, in the order of `prompts`."""
    start, tokens = clock.decode_seconds, -len(prompts)
    reqs = [Request(prompt=list(p), max_tokens=max_tokens,
                    params=SamplingParams(temperature=temp, seed=seed + i, reproducible=True))
            for i, p in enumerate(prompts)]
    pending, submitted = list(reversed(reqs)), {}

    def submit():
        req = pending.pop()
        engine.submit(req)
        submitted[req.id] = clock.decode_seconds

    for _ in range(min(slots or len(reqs), len(reqs))):
        submit()
    index = {req.id: i for i, req in enumerate(reqs)}
    waits.extend([0.0] * len(reqs))
    while engine.has_work:
        for ev in engine.step():
            tokens += len(ev.token_ids)
            _count(depths, ev.stats)
            if ev.finish_reason:
                waits[index[ev.request_id]] = clock.decode_seconds - submitted[ev.request_id]
                if pending:
                    submit()
    return tokens / max(clock.decode_seconds - start, 1e-12)


def forget_outputs(engine) -> None:
    """Empties the engine's index of finished requests' outputs (suffix_index.SharedOutputs):
    a round asks the prompts of an earlier one again (bench/batch.py's agents workload has
    eight), and a greedy answer would be drafted whole from the earlier answer, where each
    agent's request is new."""
    shared = getattr(engine.proposer, "shared_index", None)
    if shared is not None:
        shared.clear()


def play_rounds(engine, clock: DeviceClock, prompts, args, temp: float, rounds, depths: Counter, waits: list):
    """Each round's decode rate on `engine` (decode_rate), rounds numbered `rounds` (which
    prompts, which seeds); each round's waits appended to `waits`."""
    rates = []
    for r in rounds:
        forget_outputs(engine)
        n = args.concurrency * args.loop
        group = [prompts[(r * n + i) % len(prompts)] for i in range(n)]
        waits.append([])
        rates.append(decode_rate(engine, clock, group, args.max_tokens, temp, r, depths, waits[-1], args.concurrency))
    return rates


def run_setting(model, tok, device, depth, suffix: bool, prompts, args, temp: float, seed: int):
    """(per-round rates, the engine's depth counts, per-round waits of the requests) of one
    setting: depth 0 (MTP off), a fixed depth, or "adaptive", on one engine for all rounds (as a
    server keeps one)."""
    clock = DeviceClock(device, args.noise, seed, args.calibration_noise, getattr(args, "by_kind", False))
    config = EngineConfig(enable_mtp=depth != 0, num_draft=None if depth in (0, "adaptive") else depth,
                          suffix_drafts=suffix)
    with simulated(clock), tempfile.TemporaryDirectory(prefix="mlxmtp-policy-") as folder:
        if depth == "adaptive" and getattr(args, "warm", False):
            config = dataclasses.replace(config, policy_state_dir=folder)
            model.policies.clear()  # an earlier run, cold, keeps what it learnt in `folder`
            earlier = BatchGenerator(model, tok, config)
            earlier.calibrate(1)
            play_rounds(earlier, clock, prompts, args, temp, range(args.rounds, 2 * args.rounds), Counter(), [])
            earlier.close()
            model.policies.clear()  # this run reads it back after its calibration, as a restarted server
        engine = BatchGenerator(model, tok, config)
        if depth == "adaptive":
            engine.calibrate(1)
        depths, waits = Counter(), []
        rates = play_rounds(engine, clock, prompts, args, temp, range(args.rounds), depths, waits)
    if clock.kinds is not None:
        clock.kinds.show("MTP off" if depth == 0 else f"k={depth}" if depth != "adaptive" else "adaptive")
    return rates, dict(depths) if depth == "adaptive" else {}, waits


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=sorted(DEVICES), default="h100")
    ap.add_argument("--temps", default="0,0.6")
    ap.add_argument("--depths", default="1,2,3,4", help="fixed depths beside MTP off and adaptive")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=150)
    ap.add_argument("--concurrency", type=int, default=1, help="requests decoded together each round")
    ap.add_argument("--loop", type=int, default=1,
                    help="requests per slot a round: each of the --concurrency requests in flight is followed "
                         "by the next as soon as it finishes, as agents send their next request on an answer "
                         "(1: all at once)")
    ap.add_argument("--noise", type=float, default=0.1, help="lognormal sigma of each cycle's cost")
    ap.add_argument("--calibration-noise", type=float, default=None,
                    help="lognormal sigma of the start-up calibration's costs (default: --noise)")
    ap.add_argument("--suffix", action="store_true", help="suffix drafts beside the head, every drafting setting")
    ap.add_argument("--workload", choices=["code", "repeat", "rename", "edit", "agents"], default="code",
                    help="the prompts: bench/decode.py's workloads, or bench/batch.py's agents (code prompts "
                         "and edit and rename tasks in turn)")
    ap.add_argument("--warm", action="store_true",
                    help="adaptive starts from what an earlier run of it kept (engine/policy/saved.py): that run "
                         "decodes the rounds after these once, cold, and a fresh policy reads its file back")
    ap.add_argument("--by-kind", action="store_true", help="each setting's cycles by kind and batch size: "
                                                             "count, cost, tokens per cost")
    ap.add_argument("--seed", default="0", help="the noise's seed; several (0,1,2): each run, then adaptive's "
                                                  "standing over them (a run's moves by several percent)")
    args = ap.parse_args()
    path = str(demo_model_path())
    model, tok = load(path)
    ref = mlx_lm.load(path)[0] if args.workload == "repeat" else None
    prompts = (prompts_of(model, tok, "agents", args.max_tokens) if args.workload == "agents"
               else workload_prompts(args.workload, ref, tok, args.max_tokens, args.rounds))
    if args.concurrency * args.loop > len(prompts):  # a prompt asked twice in a round drafts from its first answer
        ap.error(f"--concurrency x --loop is over the workload's {len(prompts)} prompts")
    device = DEVICES[args.device]
    settings = [0, *[int(d) for d in args.depths.split(",") if d], "adaptive"]
    seeds = [int(s) for s in args.seed.split(",")]
    for temp in [float(t) for t in args.temps.split(",")]:
        standing = []
        for seed in seeds:
            results = {d: run_setting(model, tok, device, d, args.suffix and d != 0, prompts, args, temp,
                                      seed * 1000 + i) for i, d in enumerate(settings)}
            standing.append(report(args, temp, seed, settings, results))
        if len(seeds) > 1:
            over_seeds(temp, seeds, standing)


def report(args, temp: float, seed: int, settings, results) -> dict:
    """Each setting's decode rate over MTP off's (median and range over rounds), and adaptive's
    over the best fixed setting's: over the run, and per round against that round's best; with
    several requests at once, MTP off's wait for each request over the setting's: the mean, and
    the request worst off. Returns adaptive's standing: its total over the best fixed setting's,
    and its mean and worst wait against MTP off's (None with one request at a time)."""
    off = results[0][0]
    print(f"\n{args.device} costs, demo, {args.workload}, temp={temp}, concurrency={args.concurrency}"
          f"{f', loop={args.loop}' if args.loop > 1 else ''}, "
          f"noise={args.noise}, rounds={args.rounds}, seed={seed}{', suffix' if args.suffix else ''}: "
          "decode rate over MTP off")
    for d in settings:
        rates, depths, _ = results[d]
        ratios = [a / b for a, b in zip(rates, off)]
        label = "MTP off" if d == 0 else f"k={d}" if d != "adaptive" else "adaptive"
        print(f"  {label:9s} {statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})"
              + (f"  cycles {depths}" if depths else ""))
    fixed = [d for d in settings if d != "adaptive"]
    per_round = [results["adaptive"][0][r] / max(results[d][0][r] for d in fixed) for r in range(args.rounds)]
    best = max(fixed, key=lambda d: sum(results[d][0]))
    total = sum(results["adaptive"][0]) / sum(results[best][0])
    print(f"  adaptive / best fixed: {total:.3f} over the run (best: {best}); per round "
          + " ".join(f"{x:.2f}" for x in per_round))
    standing = dict(of_best=total, mean_wait=None, worst_wait=None)
    if args.concurrency > 1:
        print("  each request's wait for its answer, MTP off's over the setting's (mean, the request worst off):")
        for d in settings[1:]:
            ratios = [o / w for os, ws in zip(results[0][2], results[d][2]) for o, w in zip(os, ws)]
            label = f"k={d}" if d != "adaptive" else d
            print(f"    {label:9s} mean {statistics.mean(ratios):.3f}x  worst {min(ratios):.3f}x")
            if d == "adaptive":
                standing.update(mean_wait=statistics.mean(ratios), worst_wait=min(ratios))
    return standing


def over_seeds(temp: float, seeds, standing) -> None:
    """Adaptive's standing over several seeds of the noise: the policy's choices follow its draws
    (an early cost sample can decide a batch size's regime), so one run's total over the best
    fixed setting's moves by several percent, and a change to the policy is judged on several."""
    of_best = [s["of_best"] for s in standing]
    line = (f"\nover seeds {','.join(map(str, seeds))}, temp={temp}: adaptive / best fixed mean "
            f"{statistics.mean(of_best):.3f}, lowest {min(of_best):.3f}")
    if standing[0]["mean_wait"] is not None:
        mean, worst = statistics.mean(s["mean_wait"] for s in standing), min(s["worst_wait"] for s in standing)
        line += f"; each request's wait, MTP off's over adaptive's: mean {mean:.3f}x, worst {worst:.3f}x"
    print(line)


if __name__ == "__main__":
    main()
