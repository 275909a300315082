"""Cold-start benchmark: what one fresh `mlxmtp generate` process gives, setting by setting.

Every server start and every `mlxmtp generate` decides its draft depth from nothing: a
policy that is right when warm can still be wrong in the first hundreds of tokens of a
new process. This runs N separate processes per setting, the settings alternating round
by round (MTP off, then adaptive, then each fixed depth asked for), and reports, per
setting, its decode tokens per second relative to the MTP-off process of the same round:
min, median and max over rounds, and the spread (max - min) / max of those ratios.

    python bench/cold_start.py                         # demo, greedy, 6 rounds, off / adaptive / k=3
    python bench/cold_start.py --rounds 10 --temp 0.6 --depths 2,3 --head-alone
    python bench/cold_start.py --model /path/to/mlx-model --max-tokens 200 --markdown
    git worktree add /tmp/before HEAD~1
    python bench/cold_start.py --baseline /tmp/before    # adaptive of another checkout too

Decode tokens per second is the engine's own figure (`stats.tokens_per_second`: tokens
after the first over the decode time), so load time and prefill do not count.

Every process starts cold: none reads or writes what a policy kept from an earlier run
(MLXMTP_POLICY_STATE_DIR=none, which a checkout without that setting ignores). `--warm` adds
"adaptive, warm": processes sharing one folder of kept state (engine/policy/saved.py), the
first of them run once before the rounds, as a user's second run of a command finds it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


def run_once(model, setting: str, args) -> dict:
    """One fresh process of `mlxmtp generate` with `setting` ('off', 'adaptive', 'head alone',
    a depth, or 'baseline' / 'baseline, head alone': those from the checkout `args.baseline`)
    -> its JSON output."""
    env = dict(os.environ, MLXMTP_POLICY_STATE_DIR=args.state_dir if setting.endswith("warm") else "none")
    if setting.startswith("baseline"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.baseline, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "mlxmtp.commands", "generate", "--prompt", args.prompt, "--no-chat-template",
           "--temp", str(args.temp), "--max-tokens", str(args.max_tokens), "--json"]
    cmd += ["--model", model] if model else []
    cmd += ["--seed", "0"] if args.temp > 0 else []
    if setting == "off":
        cmd.append("--disable-mtp")
    elif setting.endswith("head alone"):
        cmd.append("--no-suffix")
    elif setting not in ("adaptive", "baseline", "adaptive, warm"):
        cmd += ["--num-draft", setting]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def measure(args) -> dict:
    """{setting: [decode tok/s of each round]} and {setting: [depths histogram]}."""
    settings = ["off", "adaptive", *(["adaptive, warm"] if args.warm else []),
                *(["head alone"] if args.head_alone else []),
                *(["baseline"] if args.baseline else []),
                *(["baseline, head alone"] if args.baseline and args.head_alone else []),
                *[d for d in args.depths.split(",") if d]]
    rates = {s: [] for s in settings}
    depths = {s: [] for s in settings}
    if args.warm:  # the run before: what it learnt is what the warm processes start from
        run_once(args.model, "adaptive, warm", args)
    for r in range(args.rounds):
        for s in settings:
            stats = run_once(args.model, s, args)["stats"]
            rates[s].append(stats["tokens_per_second"])
            depths[s].append(stats.get("depths", {}))
            print(f"round {r + 1}/{args.rounds} {s:>8}: {stats['tokens_per_second']:7.1f} tok/s, "
                  f"depths {stats.get('depths', {})}", file=sys.stderr, flush=True)
    return {"rates": rates, "depths": depths}


def summary(rates: dict) -> list:
    """Per setting (not 'off'): (setting, min, median, max, spread) of its ratio to MTP off."""
    rows = []
    for s, values in rates.items():
        if s == "off":
            continue
        ratios = [v / off for v, off in zip(values, rates["off"])]
        lo, mid, hi = min(ratios), statistics.median(ratios), max(ratios)
        rows.append((s, lo, mid, hi, (hi - lo) / hi))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path or HF id (default: the packaged demo)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--depths", default="3", help="fixed depths to run beside adaptive, comma-separated")
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--baseline", default=None, help="another checkout's root: its adaptive policy runs too")
    p.add_argument("--head-alone", action="store_true",
                   help="also adaptive with the head alone (--no-suffix; every setting else has suffix drafts)")
    p.add_argument("--warm", action="store_true",
                   help="also adaptive starting from what an earlier process of it kept (--policy-state-dir)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", action="store_true", help="print the raw measurements as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mlxmtp-policy-") as args.state_dir:
        result = measure(args)
    if args.json:
        print(json.dumps(result))
        return
    off = statistics.median(result["rates"]["off"])
    print(f"MTP off: median {off:.1f} tok/s over {args.rounds} processes (temp {args.temp}, "
          f"{args.max_tokens} tokens)")
    head = "| setting | min | median | max | spread (max-min)/max |"
    print(head if args.markdown else head.replace("|", " "))
    if args.markdown:
        print("|---|---|---|---|---|")
    for s, lo, mid, hi, spread in summary(result["rates"]):
        row = f"| {s} | {lo:.2f}x | {mid:.2f}x | {hi:.2f}x | {spread:.0%} |"
        print(row if args.markdown else row.replace("|", " "))


if __name__ == "__main__":
    main()
