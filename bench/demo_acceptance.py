"""Greedy acceptance of the demo model's head on held-out code, by depth.

    python bench/demo_acceptance.py [--model PATH] [--max-tokens 100] [--depths 1,2,3]

Acceptance is a property of the model and head (greedy, deterministic), not a timing.
"""

from __future__ import annotations

import argparse
import statistics

from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.generate import generate
from mlxmtp.models.demo_prompts import HELD_OUT_PROMPTS
from mlxmtp.models.load import load


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--depths", default="1,2,3")
    args = ap.parse_args()
    model, tok = load(args.model)
    for k in [int(d) for d in args.depths.split(",")]:
        accs, tpf = [], []
        for name, prompt in HELD_OUT_PROMPTS.items():
            s = generate(model, tok, tok.encode(prompt), max_tokens=args.max_tokens,
                         config=EngineConfig(num_draft=k)).stats.as_dict()
            accs.append(s["acceptance"])
            tpf.append(s["tokens_per_forward"])
            print(f"k={k} {name:10} acceptance {s['acceptance']:.2f}  by position "
                  f"{[round(a, 2) for a in s['acceptance_by_position']]}  tokens/forward {s['tokens_per_forward']:.2f}")
        print(f"k={k} MEAN       acceptance {statistics.mean(accs):.3f}  tokens/forward {statistics.mean(tpf):.2f}\n")


if __name__ == "__main__":
    main()
