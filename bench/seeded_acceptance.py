"""What a seed costs a sampled request: drafts kept by rejection sampling (no seed) against
drafts kept under shared noise (a seed: engine/sampling/seeded.py, the same text at every depth).

    python bench/seeded_acceptance.py [--model PATH] [--temps 0.6,1.0] [--depth 3] [--seeds 4]

Every held-out demo prompt with each of `--seeds` seeds, at a pinned depth, both ways; prints
acceptance by position, tokens per forward and decode speed, each way's mean over all runs
(runs of the two ways alternate, so a drifting machine shifts both alike).
"""

from __future__ import annotations

import argparse
import statistics

from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.generate import generate
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.models.demo_prompts import HELD_OUT_PROMPTS
from mlxmtp.models.load import load


def _run(model, tok, prompt, temp, seed, reproducible, depth, max_tokens):
    params = SamplingParams(temperature=temp, seed=seed, reproducible=reproducible)
    return generate(model, tok, tok.encode(prompt), max_tokens=max_tokens, params=params,
                    config=EngineConfig(num_draft=depth)).stats.as_dict()


def _row(name, runs):
    by_pos = [statistics.mean(r["acceptance_by_position"][i] for r in runs)
              for i in range(len(runs[0]["acceptance_by_position"]))]
    return (f"| {name} | {' '.join(f'{a:.2f}' for a in by_pos)} | "
            f"{statistics.mean(r['tokens_per_forward'] for r in runs):.2f} | "
            f"{statistics.median(r['tokens_per_second'] for r in runs):.1f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--temps", default="0.6,1.0")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    model, tok = load(args.model)
    print("| temperature, acceptance rule | acceptance by position | tokens/forward | tok/s (median) |")
    print("|---|---|---|---|")
    for temp in [float(t) for t in args.temps.split(",")]:
        runs = {False: [], True: []}
        for prompt in HELD_OUT_PROMPTS.values():
            for seed in range(args.seeds):
                for reproducible in (False, True):
                    runs[reproducible].append(_run(model, tok, prompt, temp, seed, reproducible,
                                                   args.depth, args.max_tokens))
        print(_row(f"{temp}, rejection sampling (no seed)", runs[False]))
        print(_row(f"{temp}, shared noise (seed)", runs[True]))


if __name__ == "__main__":
    main()
