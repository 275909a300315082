"""`mlxmtp bench`: the user-facing decode benchmark, in the spirit of `mlx_lm.benchmark`.

For each prompt length, one request at a time on the engine the server runs
(`engine.generate.stream_generate`): MTP off, adaptive depth, each fixed depth, and
mlx-lm's own `stream_generate` on the same model object and prompt. Every run generates
exactly `-g` tokens (EOS is ignored, as mlx_lm.benchmark does). Reported per setting:
time to first token, prompt tokens/s (prompt / TTFT), generation tokens/s (after the
first token), its ratio to mlx-lm's, MTP acceptance by draft position, tokens per
forward, depths used and peak memory; medians over `--rounds` rounds (3 by default), with
the range (min-max) of each ratio over them.

The prompt is code (the demo model's held-out prompts, repeated and cut to length): on
random tokens no drafter is accepted. The rounds are interleaved: every setting runs once
per round, one after another, in reversed order on odd rounds, and a setting's ratio to
mlx-lm is taken within each round (neighbours in time), so a machine whose speed drifts
shifts a round as a whole. A line per run goes to stderr as it ends; a ratio whose range
is wider than SPREAD_LIMIT (max / min) is reported as untrustworthy: the machine was busy
or noisy. bench/decode.py is the finer measurement.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Dict, List, Optional

import click

from .engine.limits import MAX_DRAFT_DEPTH
from .models.demo_prompts import HELD_OUT_PROMPTS

# A ratio whose largest value over the rounds exceeds its smallest by more than this is not
# to be trusted: on a quiet machine the rounds of the demo model agree within a few percent.
SPREAD_LIMIT = 1.15
NOISY = "the machine is busy or noisy; rerun with more --rounds (or on a quieter machine)"


def _int_list(text: str, name: str, low: int, high: Optional[int] = None) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=name) from e
    if any(v < low or (high is not None and v > high) for v in values):
        raise click.BadParameter(f"values must lie in [{low}, {high if high is not None else 'inf'}]", param_hint=name)
    return values


def prompt_ids(tok, n: int) -> List[int]:
    """n tokens of code."""
    text = "\n\n".join(HELD_OUT_PROMPTS.values())
    ids: List[int] = []
    while len(ids) < n:
        ids += tok.encode(text + "\n\n", add_special_tokens=False)
    return ids[:n]


def _timed(events) -> dict:
    """Drive a token stream (yielding token counts) -> ttft, decode tokens/s, tokens."""
    t0 = time.perf_counter()
    first = last = None
    n = n_first = 0
    for count in events:
        if count:
            last = time.perf_counter()
            if first is None:
                first, n_first = last, count
            n += count
    decode = (n - n_first) / (last - first) if last is not None and last > first else 0.0
    return {"ttft_s": (first or time.perf_counter()) - t0, "generation_tps": decode, "generated_tokens": n}


def run_mlx_lm(model, tok, ids: List[int], gen: int, temp: float) -> dict:
    # On use: `mlxmtp` start-up imports every subcommand module, and mlx_lm takes seconds.
    from .mlxlm.sampling import reference_tokens

    return _timed(1 for _ in reference_tokens(model, tok, ids, gen, temp))


def run_mlxmtp(model, tok, ids: List[int], gen: int, temp: float, depth) -> dict:
    """depth: 0 (MTP off), "adaptive" or a fixed draft depth."""
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    from .engine.batch import BatchGenerator
    from .engine.generate import stream_generate
    from .engine.sampling import SamplingParams

    stats: dict = {}
    # Built before the clock starts: a server builds its engine once.
    engine = BatchGenerator(model, tok, enable_mtp=depth != 0, num_draft=None if depth in (0, "adaptive") else depth)

    def counts():
        for ev in stream_generate(model, tok, ids, max_tokens=gen, params=SamplingParams(temperature=temp, seed=0),
                                  engine=engine):
            if ev.stats is not None:
                stats.update(ev.stats.as_dict())
            yield len(ev.token_ids)

    out = _timed(counts())
    if depth != 0:
        out.update({k: stats.get(k) for k in ("acceptance_by_position", "tokens_per_forward", "depths")})
    return out


def _one(model, tok, ids, gen, temp, setting) -> dict:
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    import mlx.core as mx

    mx.reset_peak_memory()
    res = run_mlx_lm(model, tok, ids, gen, temp) if setting is None else run_mlxmtp(model, tok, ids, gen, temp,
                                                                                   setting)
    res["peak_mib"] = mx.get_peak_memory() / 2**20
    res["prompt_tps"] = len(ids) / res["ttft_s"] if res["ttft_s"] > 0 else 0.0
    return res


def _range(values: List[float]) -> List[float]:
    return [min(values), max(values)]


def _spread(values: List[float]) -> Optional[float]:
    """max / min (1.0: the values agree; None: one of them is 0)."""
    return max(values) / min(values) if min(values) > 0 else None


def _summary(label: str, runs: List[dict], ref_runs: Optional[List[dict]]) -> dict:
    """Medians over rounds (acceptance: the mean by position, depths: summed); the ratio to
    mlx-lm taken within each round (`ref_runs`: mlx-lm's runs, round by round), its median
    and range, and the spread (max / min) of that ratio, or of the tokens/s (mlx-lm's own
    row, and every row without mlx-lm)."""
    med = {k: statistics.median(r[k] for r in runs) for k in ("ttft_s", "prompt_tps", "generation_tps", "peak_mib")}
    tps = [r["generation_tps"] for r in runs]
    ratios = ([r["generation_tps"] / ref["generation_tps"] if ref["generation_tps"] > 0 else 0.0
               for r, ref in zip(runs, ref_runs)] if ref_runs else None)
    out = {"setting": label, **med, "generated_tokens": runs[0]["generated_tokens"],
           "vs_mlx_lm": statistics.median(ratios) if ratios else None,
           "vs_mlx_lm_range": _range(ratios) if ratios else None,
           "generation_tps_range": _range(tps),
           "spread": _spread(ratios if ratios and label != "mlx-lm" else tps)}
    if runs[0].get("acceptance_by_position") is not None:
        by = [r["acceptance_by_position"] for r in runs]
        out["acceptance_by_position"] = [statistics.mean(a[i] for a in by if len(a) > i)
                                         for i in range(max(len(a) for a in by))]
        out["tokens_per_forward"] = statistics.median(r["tokens_per_forward"] for r in runs)
        depths: Dict[str, int] = {}
        for r in runs:
            for d, n in r["depths"].items():
                depths[str(d)] = depths.get(str(d), 0) + n
        out["depths"] = depths
    return out


def _table(result: dict) -> str:
    cols = ["setting", "TTFT s", "prompt tok/s", "gen tok/s", "vs mlx-lm (range)", "acceptance by position",
            "tok/fwd", "peak MiB"]
    rows = []
    for s in result["settings"]:
        label = s["setting"] + (" (depths " + ", ".join(f"{d}:{n}" for d, n in sorted(s["depths"].items())) + ")"
                                if s["setting"] == "adaptive" else "")
        low, high = s["vs_mlx_lm_range"] or (None, None)
        ratio = (f"{s['vs_mlx_lm']:.2f}x" + (f" ({low:.2f}-{high:.2f})" if high != low else "")
                 if s["vs_mlx_lm"] else "")
        rows.append([label, f"{s['ttft_s']:.3f}", f"{s['prompt_tps']:.1f}", f"{s['generation_tps']:.1f}", ratio,
                     " ".join(f"{a:.2f}" for a in s.get("acceptance_by_position") or []),
                     f"{s['tokens_per_forward']:.2f}" if s.get("tokens_per_forward") else "", f"{s['peak_mib']:.0f}"])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


@click.command()
@click.option("--model", default=None, help="Model folder or Hugging Face repo id (default: the demo model, mlxmtp-demo).")
@click.option("--prompt-tokens", "-p", default="128,1024", show_default=True,
              help="Prompt lengths, comma-separated.")
@click.option("--generation-tokens", "-g", default=128, show_default=True, type=click.IntRange(min=2),
              help="Tokens generated by every run.")
@click.option("--depths", default="1,2,3", show_default=True,
              help=f"Fixed draft depths to run besides MTP off and adaptive (1-{MAX_DRAFT_DEPTH}; '' for none).")
@click.option("--temp", default=0.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--rounds", "--num-trials", "-n", "rounds", default=3, show_default=True, type=click.IntRange(min=1),
              help="Interleaved rounds: every setting once per round, ratios to mlx-lm taken within a round; "
                   "medians and ranges over the rounds. A range wider than "
                   f"{SPREAD_LIMIT:.2f}x (max / min) is reported as untrustworthy.")
@click.option("--no-mlx-lm", is_flag=True, help="Leave out mlx-lm's stream_generate.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (the progress lines and bar go to stderr).")
def bench(model, prompt_tokens, generation_tokens, depths, temp, rounds, no_mlx_lm, as_json):
    """Decode speed: MTP off vs adaptive vs fixed depths vs mlx-lm, per prompt length, over
    interleaved rounds (a line per run on stderr as it ends)."""
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    from tqdm import tqdm

    from .models.load import ModelLoadError, load  # (as above)

    lengths = _int_list(prompt_tokens, "--prompt-tokens", 1)
    if not lengths:
        raise click.BadParameter("give at least one prompt length", param_hint="--prompt-tokens")
    fixed = _int_list(depths, "--depths", 1, MAX_DRAFT_DEPTH)
    try:
        m, tok = load(model, mtp=True, mtp_fallback=True)
    except ModelLoadError as e:
        raise click.ClickException(str(e)) from e
    tok._eos_token_ids = set()  # every run generates exactly -g tokens (mlx_lm.benchmark does the same)
    settings = [("mlx-lm", None)] * (not no_mlx_lm) + [("MTP off", 0)]
    if m.active:
        settings += [("adaptive", "adaptive")] + [(f"k={k}", k) for k in fixed]
    runs = len(lengths) * len(settings) * (rounds + 1)
    report = {"model": model or "mlxmtp-demo", "mtp_active": bool(m.active),
              "mtp_disabled_reason": m.disabled_reason, "generation_tokens": generation_tokens,
              "temperature": temp, "num_trials": rounds, "rounds": rounds, "spread_limit": SPREAD_LIMIT,
              "results": [], "warnings": []}
    with tqdm(total=runs, desc="mlxmtp bench", file=sys.stderr, disable=None) as bar:
        for n in lengths:
            summaries = _rounds_at(m, tok, n, settings, generation_tokens, temp, rounds, no_mlx_lm, bar)
            report["results"].append({"prompt_tokens": n, "settings": summaries})
            report["warnings"] += _noisy(n, summaries, rounds, no_mlx_lm)
    for line in report["warnings"]:
        click.echo(f"warning: {line}", err=True)
    if report["warnings"]:
        click.echo(f"warning: {NOISY}", err=True)
    if as_json:
        click.echo(json.dumps(report))
        return
    head = f"model: {report['model']}   MTP head: " + ("active" if m.active else f"inactive ({m.disabled_reason})")
    click.echo(f"{head}   generation: {generation_tokens} tokens   temp: {temp}   rounds: {rounds} "
               "(medians; ranges min-max over the rounds)")
    for result in report["results"]:
        click.echo(f"\nprompt: {result['prompt_tokens']} tokens")
        click.echo(_table(result))
    if report["warnings"]:
        click.echo(f"\nRanges wider than {SPREAD_LIMIT:.2f}x (max / min) over the rounds: {NOISY}.")


def _rounds_at(m, tok, n: int, settings: list, generation_tokens: int, temp: float, rounds: int,
               no_mlx_lm: bool, bar) -> List[dict]:
    """Each setting's summary at prompt length `n`: a warm-up run each (compiles, and the
    adaptive policy's calibration), then `rounds` interleaved rounds, a stderr line per run."""
    from tqdm import tqdm  # on use, as in bench

    ids = prompt_ids(tok, n)
    results: Dict[str, List[dict]] = {label: [] for label, _ in settings}
    for _, setting in settings:
        _one(m, tok, ids[: min(n, 64)], min(generation_tokens, 32), temp, setting)
        bar.update()
    for r in range(rounds):
        for label, setting in (settings if r % 2 == 0 else settings[::-1]):
            bar.set_postfix_str(f"prompt {n}, {label}")
            res = _one(m, tok, ids, generation_tokens, temp, setting)
            results[label].append(res)
            bar.update()
            tqdm.write(f"prompt {n}  round {r + 1}/{rounds}  {label:<8}  {res['generation_tps']:8.1f} tok/s  "
                       f"TTFT {res['ttft_s']:.3f} s", file=sys.stderr)
    ref_runs = None if no_mlx_lm else results["mlx-lm"]
    return [_summary(label, results[label], ref_runs) for label, _ in settings]


def _noisy(n: int, summaries: List[dict], rounds: int, no_mlx_lm: bool) -> List[str]:
    """A line for each setting whose ratio to mlx-lm (its tokens/s without mlx-lm) spread
    wider than SPREAD_LIMIT over the rounds."""
    lines = []
    for s in summaries:
        if rounds < 2 or s["spread"] is None or s["spread"] <= SPREAD_LIMIT or (
                s["setting"] == "mlx-lm" and not no_mlx_lm):
            continue
        what, (low, high) = (("tokens/s", s["generation_tps_range"]) if no_mlx_lm
                             else ("ratio to mlx-lm", s["vs_mlx_lm_range"]))
        lines.append(f"prompt {n}, {s['setting']}: its {what} ranged {low:.2f}-{high:.2f} over {rounds} rounds "
                     f"(max / min {s['spread']:.2f} > {SPREAD_LIMIT:.2f})")
    return lines
