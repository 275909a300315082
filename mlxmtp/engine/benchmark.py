"""The user-facing decode benchmark (`mlxmtp bench`), in the spirit of `mlx_lm.benchmark`.

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

import statistics
import sys
import time
from typing import Dict, List, Optional

from ..models.demo_prompts import HELD_OUT_PROMPTS
from .config import EngineConfig

# A ratio whose largest value over the rounds exceeds its smallest by more than this is not
# to be trusted: on a quiet machine the rounds of the demo model agree within a few percent.
SPREAD_LIMIT = 1.15
NOISY = "the machine is busy or noisy; rerun with more --rounds (or on a quieter machine)"


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
    # On use: `mlxmtp` start-up imports this module (commands/bench.py), and mlx_lm takes seconds.
    from ..mlxlm.sampling import reference_tokens

    return _timed(1 for _ in reference_tokens(model, tok, ids, gen, temp))


def run_mlxmtp(model, tok, ids: List[int], gen: int, temp: float, depth, suffix: bool = False) -> dict:
    """depth: 0 (MTP off), "adaptive" or a fixed draft depth; suffix: the suffix drafter too."""
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    from .batch import BatchGenerator
    from .generate import stream_generate
    from .sampling.params import SamplingParams

    stats: dict = {}
    # Built before the clock starts: a server builds its engine once.
    engine = BatchGenerator(model, tok, EngineConfig(enable_mtp=depth != 0, suffix_drafts=suffix,
                                                     num_draft=None if depth in (0, "adaptive") else depth))

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


def one(model, tok, ids, gen, temp, setting, suffix: bool = False) -> dict:
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    import mlx.core as mx

    mx.reset_peak_memory()
    res = run_mlx_lm(model, tok, ids, gen, temp) if setting is None else run_mlxmtp(model, tok, ids, gen, temp,
                                                                                   setting, suffix)
    res["peak_mib"] = mx.get_peak_memory() / 2**20
    res["prompt_tps"] = len(ids) / res["ttft_s"] if res["ttft_s"] > 0 else 0.0
    return res


def _range(values: List[float]) -> List[float]:
    return [min(values), max(values)]


def _spread(values: List[float]) -> Optional[float]:
    """max / min (1.0: the values agree; None: one of them is 0)."""
    return max(values) / min(values) if min(values) > 0 else None


def summary(label: str, runs: List[dict], ref_runs: Optional[List[dict]]) -> dict:
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


def table(result: dict) -> str:
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


def rounds_at(m, tok, n: int, settings: list, generation_tokens: int, temp: float, rounds: int,
               no_mlx_lm: bool, bar, suffix: bool = False) -> List[dict]:
    """Each setting's summary at prompt length `n`: a warm-up run each (compiles, and the
    adaptive policy's calibration), then `rounds` interleaved rounds, a stderr line per run."""
    from tqdm import tqdm  # on use, as commands/bench.py does

    ids = prompt_ids(tok, n)
    results: Dict[str, List[dict]] = {label: [] for label, _ in settings}
    for _, setting in settings:
        one(m, tok, ids[: min(n, 64)], min(generation_tokens, 32), temp, setting, suffix)
        bar.update()
    for r in range(rounds):
        for label, setting in (settings if r % 2 == 0 else settings[::-1]):
            bar.set_postfix_str(f"prompt {n}, {label}")
            res = one(m, tok, ids, generation_tokens, temp, setting, suffix)
            results[label].append(res)
            bar.update()
            tqdm.write(f"prompt {n}  round {r + 1}/{rounds}  {label:<8}  {res['generation_tps']:8.1f} tok/s  "
                       f"TTFT {res['ttft_s']:.3f} s", file=sys.stderr)
    ref_runs = None if no_mlx_lm else results["mlx-lm"]
    return [summary(label, results[label], ref_runs) for label, _ in settings]


def noisy(n: int, summaries: List[dict], rounds: int, no_mlx_lm: bool) -> List[str]:
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
