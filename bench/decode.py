"""Single-request decode benchmark: mlx-lm vs mlxmtp (MTP off, k = 1..4, adaptive).

For each model and temperature, all settings run in ONE process, round by round, and
every mlxmtp run is paired with an mlx-lm run of the same prompt, the two advancing in
turns (16 tokens, 4 on a quantized model: ~0.3 s and ~1 s here), each timed on its own
turns (this shared machine's speed jumps within seconds; whole runs one after the other
differ by up to 30%, turns see the same phases). Only ratios are meaningful; the table
gives their median and range over rounds. Also measures the cost of a (k+1)-token
forward relative to a 1-token forward, from which the ideal speedup of depth k over
plain decoding is
    ideal(k) = tokens_per_forward(k) / (cost(k+1 tokens) / cost(1 token))
and measured/ideal is the engine's efficiency (draft cost and overhead included).

    python bench/decode.py                      # demo model and its 4-bit twin, greedy and temp 0.6
    python bench/decode.py --models demo --temps 0 --rounds 5 --markdown
    python bench/decode.py --models /path/to/mlx-model --max-tokens 200
    python bench/decode.py --models demo --temps 0 --depths 2,3 --pipelined   # each depth also pipelined
    python bench/decode.py --models demo --depths 3 --suffix --workload repeat  # suffix drafts, text that repeats
    python bench/decode.py --models demo --depths 2,3 --suffix --workload edit --max-tokens 400  # agents' edits

Sampled rows are seeded as the server seeds a request with a seed (`reproducible`: each token
decided by the seed and its position, engine/sampling/seeded.py), so every mlxmtp setting writes
the same text in a round and the ratios compare speed, not texts (unseeded, a setting that drafts
differently writes other text, which at 0.6 may copy more, or stop after 35 tokens instead of
200); `--rejection` samples as unseeded requests do instead.

Prompts: code, a different one each round (the demo model's held-out prompts); with
`--workload rename|edit`, copy and edit tasks on held-out files (demo_tasks.py), chat-rendered.
Models: `demo` (the packaged demo model), `demo-4bit` (built by bench/quantized_demo.py
into a temporary folder), or a path / HF id.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_sampler

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.generate import stream_generate
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.mlxlm import adapter
from mlxmtp.models import demo_tasks
from mlxmtp.models.demo import demo_model_path
from mlxmtp.models.demo_prompts import HELD_OUT_PROMPTS
from mlxmtp.models.load import load

PROMPT = '''def _parse_args(argv):
    """Parse command line arguments for the tool."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", help="input file")
'''
# Round r uses PROMPTS[r % len(PROMPTS)] (the mlx-lm runs beside each mlxmtp run use the
# same one): greedy decoding of one prompt is one deterministic text, on which which depth
# wins is partly the luck of where its cycles happen to start (demo, 150 tokens of the
# first prompt: fixed k = 2 kept 2.61 tokens per cycle, k = 3 2.92; 200 tokens of each of
# these six: 2.55 and 3.11).
PROMPTS = [PROMPT, *HELD_OUT_PROMPTS.values()]


def forward_costs(model, sizes, context=128, reps=20):
    """Cost of one T-token forward relative to a 1-token forward, for each T in `sizes`, at
    `context` tokens of cache: the median over `reps` rounds of the ratio of the two timed
    back to back (like the decode runs, a ratio of neighbours: the speed of this machine
    jumps between seconds). The cache is filled once; after each timed forward the
    attention caches are trimmed back (the Gated DeltaNet state just moves on: its cost
    does not depend on its values)."""
    parts = model.parts
    cache = adapter.make_cache(parts, 1)
    logits, _ = adapter.forward(parts, mx.zeros((1, context), mx.int32), cache)
    mx.eval(logits)

    def timed(T):
        t0 = time.perf_counter()
        logits, _ = adapter.forward(parts, mx.zeros((1, T), mx.int32), cache)
        mx.eval(logits, *cache.arrays())
        dt = time.perf_counter() - t0
        cache.trim_rows([T])
        return dt

    return paired_ratios(timed, lambda T: timed(1), sizes, reps)


def paired_ratios(timed_a, timed_b, sizes, reps):
    """{T: median over `reps` rounds of timed_a(T) / timed_b(T)}, the two timed back to back,
    alternating which goes first; two more rounds before them warm up."""
    ratios = {T: [] for T in sizes}
    for r in range(reps + 2):
        for T in sizes:
            if r % 2:
                b, a = timed_b(T), timed_a(T)
            else:
                a, b = timed_a(T), timed_b(T)
            if r >= 2:
                ratios[T].append(a / b)
    return {T: statistics.median(v) for T, v in ratios.items()}


def mlx_lm_tokens(ref, tok, prompt, n, temp, seed):
    """mlx-lm's `stream_generate` (what users have today): yields tokens produced, then None."""
    mx.random.seed(seed)
    for _ in mlx_lm.stream_generate(ref, tok, prompt, max_tokens=n, sampler=make_sampler(temp=temp)):
        yield 1
    yield None


def mlxmtp_tokens(model, tok, prompt, n, temp, seed, k, out, options=None, same_text=True):
    """mlxmtp on the engine the server runs (k: 0 = MTP off, a pinned depth, or "adaptive";
    `options`: more engine options): returns (generator of tokens produced per step and
    then None, the engine); the request's stats land in out["stats"]."""
    engine = BatchGenerator(model, tok, EngineConfig(enable_mtp=k != 0, num_draft=None if k in (0, "adaptive") else k,
                                                     **(options or {})))

    def tokens():
        for ev in stream_generate(model, tok, prompt, max_tokens=n, engine=engine,
                                  params=SamplingParams(temperature=temp, seed=seed, reproducible=same_text)):
            if ev.stats is not None:  # on the last event
                out["stats"] = ev.stats.as_dict()
            yield len(ev.token_ids)
        yield None

    return tokens(), engine


def interleaved(sides, chunk=16):
    """Run generators in turns of `chunk` tokens each and time each side's own turns.

    Tokens/s is counted after the first token (prefill excluded, as for every setting).
    The device is synchronized at the end of every turn and the wait billed to that turn,
    so no side's queued work runs in another's time; both sides lose their host/device
    overlap once per turn (at most ~1% of a plain-decoding turn of 16 tokens: one graph
    build; drafting cycles are synchronous and lose nothing, so this favours MTP by at
    most that much). Turns alternate in order, and an engine is told the time spent in
    the other side's turns (`skip_time`) so its depth policy does not bill it to a cycle.
    Returns, per side, {"tokens", "seconds", "tps"} of the timed turns, "first" (tokens of
    the untimed first turn) and "done".
    """
    state = [{"tokens": 0, "seconds": 0.0, "done": False} for _ in sides]

    def turn(i, limit):
        gen, st, got = sides[i][0], state[i], 0
        t0 = time.perf_counter()
        while got < limit:
            n = next(gen)
            if n is None:
                st["done"] = True
                break
            got += n
        mx.synchronize()
        dt = time.perf_counter() - t0
        for j, (_, engine) in enumerate(sides):
            if j != i and engine is not None:
                engine.skip_time(dt)
        return got, dt

    for i in range(len(sides)):
        got, _ = turn(i, 1)  # prefill and first token: not timed
        state[i]["first"] = got
    r = 0
    while not all(st["done"] for st in state):
        order = range(len(sides)) if r % 2 == 0 else reversed(range(len(sides)))
        for i in order:
            if not state[i]["done"]:
                got, dt = turn(i, chunk)
                state[i]["tokens"] += got
                state[i]["seconds"] += dt
        r += 1
    return [dict(st, tps=st["tokens"] / max(st["seconds"], 1e-9)) for st in state]


# Variants of every drafting setting a run may add beside it, in the same rounds.
VARIANTS = {
    "compiled": {"compile_steps": True},  # the head's steps and the accept step compiled
    "pipelined": {"pipeline_drafts": True, "shape_stable": True},  # cycles built on unread ones
    "suffix": {"suffix_drafts": True},  # suffix drafts beside the head (serve's default)
}


def asked_again(ref, tok, prompt, n):
    """The "repeat" workload: the prompt, the model's own greedy answer to it and the prompt
    again, as when an agent asks for what it was given before; the demo model then mostly
    writes that answer again, which the suffix drafter finds in its prompt."""
    answer = [r.token for r in mlx_lm.stream_generate(ref, tok, prompt, max_tokens=n, sampler=make_sampler(temp=0.0))]
    return prompt + answer + prompt


def workload_prompts(workload: str, ref, tok, max_tokens: int, rounds: int) -> list:
    """The prompts (token ids) of a workload: "code", the demo's code prompts; "repeat", each
    asked again after the model's own answer (`asked_again`, `ref` the mlx-lm model);
    "rename" and "edit", a task per held-out file (demo_tasks), `rounds` of them."""
    if workload in ("rename", "edit"):
        return [tok.encode(demo_tasks.render(tok, task, with_answer=False))
                for task in demo_tasks.held_out_tasks(workload, rounds)]
    prompts = [tok.encode(p) for p in PROMPTS]
    return [asked_again(ref, tok, p, max_tokens) for p in prompts] if workload == "repeat" else prompts


def bench_model(name, path, temps, depths, rounds, max_tokens, markdown, quantized=False, chunk=16,
                compiled=False, shape_stable=None, pipelined=False, suffix=False, workload="code", same_text=True):
    model, tok = load(path)
    ref, _ = mlx_lm.load(path)
    prompts = workload_prompts(workload, ref, tok, max_tokens, rounds)
    drafting = [(f"mlxmtp k={k}", k) for k in depths] + [("mlxmtp adaptive", "adaptive")]
    variants = [v for v, on in (("compiled", compiled), ("pipelined", pipelined), ("suffix", suffix)) if on]
    twins = [(f"{label}, {v}", k) for v in variants for label, k in drafting]
    options = {f"{label}, {v}": VARIANTS[v] for v in variants for label, _ in drafting}
    if shape_stable is not None:  # else the backend's default (on for GPUs)
        options = {label: {"shape_stable": shape_stable, **options.get(label, {})}
                   for label, _ in drafting + twins + [("mlxmtp MTP off", 0)]}
    settings = [("mlx-lm generate", None), ("mlxmtp MTP off", 0)] + drafting + twins
    reps = 5 if quantized else 20
    # by depth k: a verify of k+1 tokens (adaptive may use any depth)
    cost = {T - 1: c for T, c in forward_costs(model, range(2, 6), reps=reps).items()}
    for temp in temps:
        # Warm-up: every setting alone once (the adaptive policy's cost calibration belongs
        # to the model, once per server lifetime, so it is warmed up like the rest). Peak
        # memory is measured here: interleaved runs hold both sides' buffers at once.
        peak = {}
        for label, k in settings:
            mx.reset_peak_memory()
            if k is None:
                gen = mlx_lm_tokens(ref, tok, prompts[0], max_tokens, temp, 0)
            else:
                gen, engine = mlxmtp_tokens(model, tok, prompts[0], max_tokens, temp, 0, k, {}, options.get(label),
                                            same_text)
                engine.calibrate(1)  # greedy and sampled, as the server at start-up (a no-op once done)
            for _ in gen:
                pass
            peak[label] = mx.get_peak_memory()
        ours = [(label, k) for label, k in settings if k is not None]
        ref_label = settings[0][0]
        results = {label: [] for label, _ in settings}
        paired = {label: [] for label, _ in ours}  # per round: tok/s / tok/s of the mlx-lm run beside it
        for r in range(rounds):
            prompt = prompts[r % len(prompts)]
            # Every mlxmtp run is paired with an mlx-lm run of the same prompt, the two in
            # turns of `chunk` tokens (`interleaved`): this machine's speed jumps by tens of
            # percent within seconds, and so both sides see the same phases. Odd rounds run
            # the settings in reverse order.
            for label, k in (ours if r % 2 == 0 else ours[::-1]):
                out = {}
                mine = mlxmtp_tokens(model, tok, prompt, max_tokens, temp, r, k, out, options.get(label), same_text)
                theirs = (mlx_lm_tokens(ref, tok, prompt, max_tokens, temp, r), None)
                res, base = interleaved([mine, theirs], chunk=chunk)
                results[label].append(dict(res, stats=out["stats"]))
                results[ref_label].append(base)
                paired[label].append(res["tps"] / base["tps"])
        print(f"\nmodel: {name}   workload: {workload}   temp={temp}   max_tokens={max_tokens}   rounds={rounds}   "
              f"turns={chunk} tokens "
              "(medians; speedups: of each run against the mlx-lm run interleaved with it)")
        print("forward cost relative to 1 token: " + ", ".join(f"T={k + 1}: {v:.2f}x" for k, v in cost.items()))
        cols = ["setting", "tok/s", "vs mlx-lm", "range", "acceptance by position", "tok/fwd", "ideal", "meas/ideal",
                "peak MiB"]
        rows = []
        for label, k in settings:
            tps = statistics.median(x["tps"] for x in results[label])
            ratios = paired.get(label, [1.0])
            vs_ref = statistics.median(ratios)
            vs_off = statistics.median(x / y for x, y in zip(ratios, paired["mlxmtp MTP off"]))
            row = [label, f"{tps:.1f}", f"{vs_ref:.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}" if label in paired else "",
                   "", "1.00" if k in (None, 0) else "", "", "", f"{peak[label] / 2**20:.0f}"]
            if k not in (None, 0):
                st = [x["stats"] for x in results[label]]
                by = _pooled_by_position(st)
                tpf = statistics.median(s["tokens_per_forward"] for s in st)
                row[4] = " ".join(f"{a:.2f}" for a in by)
                row[5] = f"{tpf:.2f}"
                if k != "adaptive":
                    ideal = tpf / cost[k]
                    row[6], row[7] = f"{ideal:.2f}", f"{vs_off / ideal:.2f}"
                else:
                    depths_used = {}
                    for s in st:
                        for d, n in s["depths"].items():
                            depths_used[int(d)] = depths_used.get(int(d), 0) + n
                    row[0] += " (depths used: " + ", ".join(f"{d}:{n}" for d, n in sorted(depths_used.items())) + ")"
            rows.append(row)
        _print_table(cols, rows, markdown)


def _pooled_by_position(stats):
    """Acceptance by position, the mean over rounds of each round's rate."""
    out = []
    for i in range(max(len(s["acceptance_by_position"]) for s in stats)):
        vals = [s["acceptance_by_position"][i] for s in stats if len(s["acceptance_by_position"]) > i]
        out.append(statistics.mean(vals))
    return out


def _print_table(cols, rows, markdown):
    if markdown:
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def model_path(name, tmp):
    """(path, quantized) of a model named on the command line: "demo", "demo-4bit" (made
    under `tmp`), or a path or Hub id."""
    if name == "demo":
        return str(demo_model_path()), False
    if name == "demo-4bit":
        from quantized_demo import quantized_demo

        return str(quantized_demo(f"{tmp}/demo-4bit", bits=4)), True
    from mlxmtp.models.inspection import inspect_model

    return name, bool(inspect_model(name).get("quantization"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="demo,demo-4bit")
    ap.add_argument("--temps", default="0,0.6")
    ap.add_argument("--max-tokens", type=int, default=150)
    ap.add_argument("--max-tokens-quantized", type=int, default=80,
                    help="for quantized models (MLX's CPU quantized kernels are ~10x slower)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--rounds-quantized", type=int, default=6)
    ap.add_argument("--chunk", type=int, default=16, help="tokens per turn of the interleaved runs")
    ap.add_argument("--chunk-quantized", type=int, default=4,
                    help="the same for quantized models: ~1 s turns there, like ~0.3 s on the demo")
    ap.add_argument("--depths", default="1,2,3,4")
    ap.add_argument("--compiled", action="store_true",
                    help="also run each drafting setting with compile_steps (the head's steps and the accept step compiled)")
    ap.add_argument("--pipelined", action="store_true",
                    help="also run each drafting setting with pipeline_drafts (each cycle built on the unread one)")
    ap.add_argument("--suffix", action="store_true",
                    help="also run each drafting setting with suffix drafts beside the head")
    ap.add_argument("--workload", choices=["code", "repeat", "rename", "edit"], default="code",
                    help="code: the held-out prompts; repeat: each prompt, the model's answer and the prompt again; "
                         "rename: print a held-out file with a name changed; edit: an Edit tool call on a held-out "
                         "file read earlier in the conversation (mlxmtp/models/demo_tasks.py)")
    ap.add_argument("--shape-stable", action="store_true",
                    help="shape-stable caches on every mlxmtp engine (the GPU default) on any backend")
    ap.add_argument("--rejection", action="store_true",
                    help="sample as unseeded requests do (each setting writes its own text) instead of seeded")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",") if d]  # "" : MTP off and adaptive only
    temps = [float(t) for t in args.temps.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path, quantized = model_path(name, tmp)
            n = args.max_tokens_quantized if quantized else args.max_tokens
            rounds = args.rounds_quantized if quantized else args.rounds
            chunk = args.chunk_quantized if quantized else args.chunk
            bench_model(name, path, temps, depths, rounds, n, args.markdown, quantized, chunk, args.compiled,
                        args.shape_stable or None, args.pipelined, args.suffix, args.workload, not args.rejection)


if __name__ == "__main__":
    main()
