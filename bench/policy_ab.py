"""The adaptive depth policy against a variant of its settings, side by side in one run.

Four mlxmtp settings on the demo model's held-out code prompts: MTP off, a fixed depth, the
adaptive policy as it ships (`PolicyConfig()`) and the adaptive policy with some of its knobs
changed (`--set name=value`, fields of engine/policy/config.py's PolicyConfig), each paired
with an mlx-lm run of the same prompt and seed in turns (bench/decode.py's `interleaved`),
settings in reverse order every other round. Each adaptive setting keeps a policy of its own
for the whole run, as a server keeps one per model (what one request learns serves the next),
so a change that only shows across requests (a class's history, a request's own first drafts)
shows here. Sampled rows are seeded and reproducible, as in bench/decode.py: every setting
writes the same text (the policy learns from their drafts' chances under the shared noise);
`--rejection` samples as unseeded requests do (rejection sampling, each setting its own text;
the chances min(1, p(x) / q(x))).

    python bench/policy_ab.py --set request_weight=16 --temps 0.6 --rounds 6
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import decode
import mlx_lm

from mlxmtp.engine.pieces import policy_key
from mlxmtp.engine.policy.adaptive import DepthPolicy
from mlxmtp.engine.policy.config import PolicyConfig
from mlxmtp.models.demo import demo_model_path
from mlxmtp.models.load import load


def variant_config(assignments):
    """PolicyConfig with `name=value` fields changed (each value parsed as its field's type)."""
    types = {f.name: type(f.default) for f in dataclasses.fields(PolicyConfig)}
    changes = {}
    for item in assignments:
        name, value = item.split("=", 1)
        if name not in types:
            raise SystemExit(f"--set: PolicyConfig has no field {name!r} (fields: {', '.join(types)})")
        changes[name] = value.lower() in ("1", "true", "yes") if types[name] is bool else types[name](value)
    return PolicyConfig(**changes)


def use_policy(model, policy):
    """Make `policy` the one every adaptive head-alone engine of `model` built next takes
    (engine/pieces.shared_policy, with EngineConfig's defaults)."""
    model.policies[policy_key(policy.max_depth, None)] = policy


def mlxmtp_side(model, tok, prompt, max_tokens, temp, seed, k, policy, stats, same_text=True):
    """bench/decode.py's mlxmtp side (tokens per step, then None), on `policy` where given."""
    if policy is not None:
        use_policy(model, policy)
    return decode.mlxmtp_tokens(model, tok, prompt, max_tokens, temp, seed, k, stats, same_text=same_text)


def run_round(model, tok, ref, settings, prompt, temp, seed, max_tokens, reverse, same_text=True):
    """{label: (speed-up against the mlx-lm run beside it, the request's stats)} for one prompt."""
    out = {}
    for label, k, policy in (settings[::-1] if reverse else settings):
        stats = {}
        mine = mlxmtp_side(model, tok, prompt, max_tokens, temp, seed, k, policy, stats, same_text)
        theirs = (decode.mlx_lm_tokens(ref, tok, prompt, max_tokens, temp, seed), None)
        res, base = decode.interleaved([mine, theirs])
        out[label] = (res["tps"] / base["tps"], stats.get("stats") or {})
    return out


def first_drafts_by_depth(policy):
    """Per class, "k=K kept/tried" of first drafts in the policy's own (decayed) counts: what
    each depth's level of acceptance was learnt from (engine/policy/acceptance.py)."""
    rows = {}
    for (cls, k), tried in sorted(policy.accept.tried.items(), key=str):
        if tried[1]:
            rows.setdefault(cls, []).append(f"k={k} {policy.accept.kept[cls, k][1]:.0f}/{tried[1]:.0f}")
    return "; ".join(f"{cls}: {', '.join(v)}" for cls, v in rows.items())


def report(temp, ratios, plain_cycles):
    print(f"\ntemp={temp}: speed-ups against mlx-lm, median (mean) over {len(ratios['MTP off'])} rounds")
    for label, values in ratios.items():
        print(f"  {label:28s} {statistics.median(values):.2f}x ({statistics.mean(values):.2f}x)"
              + (f"   plain cycles: {plain_cycles[label]}" if label in plain_cycles else ""))
    fixed = [label for label in ratios if label.startswith("k =")][0]
    best = [max(a, b) for a, b in zip(ratios["MTP off"], ratios[fixed])]
    for label in ratios:
        if label.startswith("adaptive"):
            print(f"  {label} / best of MTP off and {fixed}, round by round: "
                  f"{sum(ratios[label]) / sum(best):.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a PolicyConfig field of the variant (repeatable)")
    ap.add_argument("--temps", default="0.6")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--depth", type=int, default=2, help="the fixed depth beside them")
    ap.add_argument("--max-tokens", type=int, default=150)
    ap.add_argument("--rejection", action="store_true",
                    help="sample as unseeded requests do (each setting writes its own text) instead of seeded")
    args = ap.parse_args()
    variant = variant_config(args.set)
    path = str(demo_model_path())
    model, tok = load(path)
    ref, _ = mlx_lm.load(path)
    prompts = [tok.encode(p) for p in decode.PROMPTS]
    shipped, changed = DepthPolicy(), DepthPolicy(config=variant)
    settings = [("MTP off", 0, None), (f"k = {args.depth}", args.depth, None), ("adaptive", "adaptive", shipped),
                ("adaptive, " + ", ".join(args.set), "adaptive", changed)]
    for temp in [float(t) for t in args.temps.split(",")]:
        for _, k, policy in settings:  # warm-up, as bench/decode.py's; the policies calibrate here
            gen, engine = mlxmtp_side(model, tok, prompts[0], args.max_tokens, temp, 0, k, policy, {}, not args.rejection)
            engine.calibrate(1)  # greedy and sampled, as the server at start-up (a no-op once done)
            for _ in gen:
                pass
        ratios = {label: [] for label, _, _ in settings}
        plain = {label: 0 for label, k, _ in settings if k == "adaptive"}
        for r in range(args.rounds):
            got = run_round(model, tok, ref, settings, prompts[r % len(prompts)], temp, r, args.max_tokens, r % 2 == 1,
                            not args.rejection)
            for label, (ratio, stats) in got.items():
                ratios[label].append(ratio)
                if label in plain:
                    plain[label] += int(stats.get("depths", {}).get(0, 0))
            print(f"round {r}: " + "  ".join(f"{label} {ratio:.2f}" for label, (ratio, _) in got.items()), flush=True)
        report(temp, ratios, plain)
        for label, _, policy in settings[2:]:
            print(f"  {label}: first drafts kept by depth, {first_drafts_by_depth(policy)}")


if __name__ == "__main__":
    main()
