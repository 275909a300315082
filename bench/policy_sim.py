"""The depth policy on a simulated stream of sampled requests, against every fixed depth.

bench/policy_ab.py measures a policy variant on the demo itself, where a run takes minutes and
its "of best" moves by 0.1 from run to run. This drives the policy (engine/policy) with cycles
whose costs and kept drafts are drawn from what the demo was measured to do at T = 0.6
(BENCHMARKS.md, "The depth policy against a variant of it"): a cycle of depth k costs COSTS[k]
plain cycles (the first after plain decoding SWITCH more), seen through lognormal noise
(`--noise`); a request's first draft is kept 57% of the time in its answer's first 16 tokens,
66% up to 64 and 72% after, shifted per request by a normal offset; deeper drafts are kept a
little more or less often than the first (SCENARIOS: the offset's spread and that difference).
Each draft's own chance of being kept is drawn about that mean (a Beta whose spread is
CHANCE_SPREAD of a coin's, as measured on the demo) and told to the policy, as the engine tells
a sampled row's (engine/sampling/accept.keep_chances; `--set keep_chances=false` ignores it).
Requests of 100-250 tokens come one after another to one policy, which learns from each as a
server's does. Deterministic: a seed draws the same requests for every setting, and a
variant's figures differ from the shipped policy's by what it decides.

Reported per scenario: the policy's tokens per unit of cost over the best fixed depth's
(MTP off included) on the same requests, the worst and the mean over the seeds, and the share
of its cycles decoded plainly.

    python bench/policy_sim.py                               # the policy as it ships
    python bench/policy_sim.py --set margin=0 --set caution=0
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections import Counter

from policy_ab import variant_config

from mlxmtp.engine.policy.adaptive import DepthPolicy
from mlxmtp.engine.policy.base import row_class

COSTS = [1.0, 1.5, 1.9, 2.0, 2.4]  # plain cycles a cycle of depth k costs: the demo's at T = 0.6
SWITCH = 1.0  # plain cycles a first drafting cycle after plain decoding costs beyond its own (the head catches up)
OPENING = [(16, 0.57), (64, 0.66), (None, 0.72)]  # first drafts kept, up to an answer's token n
SCENARIOS = [dict(deeper=-0.05, spread=0.05), dict(deeper=0.0, spread=0.1)]
# A draft's keep chance spreads 0.26 about its request's mean where its outcome spreads 0.32
# (the demo, k = 2, T = 0.6: BENCHMARKS.md, keep chances): a Beta of mean m and sum of
# parameters S spreads sqrt(1 / (S + 1)) of a coin's.
CHANCE_SPREAD = 0.26 / 0.32
BETA_SUM = 1 / CHANCE_SPREAD**2 - 1


def first_kept(position: int, offset: float) -> float:
    """The chance that a first draft at this position of an answer is kept."""
    base = next(a for end, a in OPENING if end is None or position < end)
    return min(0.97, max(0.05, base + offset))


def run(seed: int, policy=None, fixed: int = 0, deeper: float = 0.0, spread: float = 0.05,
        requests: int = 24, noise: float = 0.2):
    """(tokens per unit of cost, Counter of depths) of `policy` (None: the fixed depth) on the
    seed's stream of requests."""
    draw = random.Random(seed)
    stream = [(draw.gauss(0, spread), draw.randint(100, 250)) for _ in range(requests)]
    luck = random.Random(seed * 7919 + 1)
    if policy is not None:  # the start-up calibration, as noisy as the cycles
        policy.seed_costs(1, {k: c * luck.lognormvariate(0, noise) for k, c in enumerate(COSTS)}, "sampled")
    tokens, cost, prev, depths = 0, 0.0, None, Counter()
    for r, (offset, length) in enumerate(stream):
        request, position = ("request", r), 0
        if policy is not None:
            policy.request_started(row_class("sampled", 0), request)
        while position < length:
            limit = length - position - 1
            classes = [row_class("sampled", position)]  # as the engine tells a row's class
            k = min(fixed, limit) if policy is None else policy.choose(
                1, limit=limit, classes=classes, requests=[request])
            kept, chances = _kept(k, first_kept(position, offset), deeper, luck)
            switched = prev == 0 and k > 0
            paid = COSTS[k] + (SWITCH if switched else 0.0)
            seen = paid * luck.lognormvariate(0, noise)
            if policy is not None:  # timed as the engine times: not the first cycle after a switch
                timed = prev is not None and (prev == 0) == (k == 0)
                policy.update(k, 1, seen if timed else None, [kept], classes,
                              switch_seconds=seen if switched else None, requests=[request],
                              chances=[chances] if k else None)
            prev, depths[k] = k, depths[k] + 1
            position, tokens, cost = position + kept + 1, tokens + kept + 1, cost + paid
    return tokens / cost, depths


def _kept(k: int, first: float, deeper: float, luck: random.Random):
    """(drafts kept of k: each in turn, until one is not; each draft's keep chance)."""
    means = [first] + [min(0.97, first + deeper)] * (k - 1)
    chances = [luck.betavariate(m * BETA_SUM, (1 - m) * BETA_SUM) for m in means]
    return next((i for i in range(k) if luck.random() >= chances[i]), k), chances


def scenario(make_policy, seeds: int, **kw):
    """(worst, mean) of the policy's rate over the best fixed depth's, and its plain share."""
    ratios, plain = [], []
    for seed in range(seeds):
        rate, depths = run(seed, make_policy(), **kw)
        best = max(run(seed, None, fixed=k, **kw)[0] for k in range(len(COSTS)))
        ratios.append(rate / best)
        plain.append(depths[0] / sum(depths.values()))
    return min(ratios), statistics.mean(ratios), statistics.mean(plain)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a PolicyConfig field of the policy simulated (repeatable)")
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--noise", type=float, default=0.2, help="sd of a cycle's seen cost's log")
    args = ap.parse_args()
    config = variant_config(args.set)
    print("policy:", ", ".join(args.set) or "as it ships")
    for kw in SCENARIOS:
        worst, mean, plain = scenario(lambda: DepthPolicy(config=config), args.seeds, noise=args.noise, **kw)
        print(f"  deeper drafts {kw['deeper']:+.2f}, requests' spread {kw['spread']:.2f}: of best fixed "
              f"worst {worst:.3f}, mean {mean:.3f}; plain cycles {plain:.0%}")


if __name__ == "__main__":
    main()
