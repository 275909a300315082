"""What suffix drafting (engine/suffix_index.py, issue 44) would give on an agent's edits, and
what its index costs, with no model: a perfect verifier keeps every draft token equal to the
true continuation, then adds one token of its own, as a verify cycle does.

The "agent" context is this repository's code, cut into tokens by a regex (words, runs of
white space, single symbols; about as fine as a BPE on code): a prompt of --prompt-tokens
tokens that reads other files and then the file to edit. Outputs: `rewrite` (the file with an
identifier renamed and every 15th line replaced), `edit` (an Edit call: a 40-line block of the
file, then that block with two lines changed and one added, in Qwen3-Coder XML: raw text),
`edit-json` (the same call with JSON arguments, as Hermes-style templates write it: the block
escaped), `patch` (the same change as Codex's apply_patch writes it: two hunks, three lines
kept on each side, raw), `patch-json` (that patch in a shell call's JSON arguments), `fresh` (a
file the prompt does not hold: nothing to copy but idioms). Each runs with the request's own
index alone and with a shared index that holds the rest of the repository as earlier outputs;
the Edit calls and patches also with the prompt's views beside it (`+views`, proposers/views.py:
the prompt as a JSON string, its numbered listings without their numbers; for a patch, its
lines behind " " and "-" too). Then those again, the file to edit read with its lines numbered
as Claude Code's Read tool shows them (`cat -n`: `     1\tline`).

Printed per output: tokens per cycle (the speed-up bound at a free verify), the share of
cycles with a draft, the mean draft length, acceptance (kept / drafted tokens), the mean
estimated score (expected kept tokens) against the mean kept; then the index's costs (a
proposal timed as the least of 3 runs; the append that merges the unsorted tail, on its own).

    python bench/suffix_index.py [--prompt-tokens 30000] [--max-len 32] [--min-prob 0.1]
        [--min-match 2] [--max-match 32] [--spec-factor 1.0]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections import Counter
from pathlib import Path

from mlxmtp.engine.proposers.views import PromptViews
from mlxmtp.engine.suffix_index import SharedOutputs, SuffixDrafter

ROOT = Path(__file__).resolve().parent.parent
PIECES = re.compile(r"\w+|\s+|[^\w\s]")
TARGET = ROOT / "mlxmtp" / "engine" / "prefix" / "cache.py"  # read in the prompt, then edited
FRESH = ROOT / "mlxmtp" / "engine" / "memory.py"  # in no prompt and no shared output


class Tokenizer:
    def __init__(self) -> None:
        self.ids: dict = {}
        self.pieces: list = []

    def __call__(self, text: str) -> list:
        out = []
        for p in PIECES.findall(text):
            if p not in self.ids:
                self.ids[p] = len(self.pieces)
                self.pieces.append(p)
            out.append(self.ids[p])
        return out

    def encode(self, text: str, add_special_tokens: bool = False) -> list:
        return self(text)

    def decode(self, ids: list) -> str:
        return "".join(self.pieces[i] for i in ids)


def _files(exclude) -> list:
    return [p for p in sorted((ROOT / "mlxmtp").rglob("*.py")) if p not in exclude]


def numbered(text: str) -> str:
    """`text` as `cat -n` lists it (Claude Code's Read tool)."""
    return "".join(f"{i:6d}\t{line}" for i, line in enumerate(text.splitlines(keepends=True), 1))


def agent_prompt(tok: Tokenizer, n_tokens: int, listed=lambda text: text) -> list:
    """Files read earlier, then the file to edit (shown as `listed` renders it), then the
    request: about n_tokens tokens."""
    tail = tok("<tool_response>\n" + listed(TARGET.read_text()) + "</tool_response>\nRename it and fix it.\n")
    prompt: list = []
    for path in _files({TARGET, FRESH}):
        if len(prompt) + len(tail) >= n_tokens:
            break
        prompt += tok(f"<tool_response>\n{path.read_text()}</tool_response>\n")
    return prompt[:max(0, n_tokens - len(tail))] + tail


def outputs(tok: Tokenizer) -> dict:
    text = TARGET.read_text()
    lines = text.splitlines(keepends=True)
    other = FRESH.read_text().splitlines(keepends=True)
    words = Counter(w for w in re.findall(r"[A-Za-z_]\w{3,}", text) if w not in {"self", "None", "return"})
    name = words.most_common(1)[0][0]
    renamed = re.sub(rf"\b{name}\b", name + "_v2", text).splitlines(keepends=True)
    rewrite = "".join(other[i % len(other)] if i % 15 == 14 else line for i, line in enumerate(renamed))
    block = lines[len(lines) // 3:len(lines) // 3 + 40]
    new = block[:10] + ["        # checked above\n", other[5]] + block[11:30] + [other[7]] + block[31:]
    edit = ('<tool_call>\n<function=Edit>\n<parameter=old_string>\n' + "".join(block)
            + '</parameter>\n<parameter=new_string>\n' + "".join(new) + '</parameter>\n</function>\n')
    as_json = json.dumps({"name": "Edit", "arguments": {"old_string": "".join(block), "new_string": "".join(new)}})
    hunks = [(block[7:10], block[10:11], new[10:12], block[11:14]), (block[27:30], block[30:31], [other[7]], block[31:34])]
    patch = "*** Begin Patch\n*** Update File: mlxmtp/engine/prefix/cache.py\n" + "".join(
        "@@\n" + "".join(" " + x for x in before) + "".join("-" + x for x in gone) + "".join("+" + x for x in added)
        + "".join(" " + x for x in after) for before, gone, added, after in hunks) + "*** End Patch\n"
    shell = json.dumps({"name": "shell", "arguments": {"command": ["apply_patch", patch]}})
    return {"rewrite": tok(rewrite), "edit": tok(edit), "edit-json": tok(f"<tool_call>\n{as_json}\n</tool_call>"),
            "patch": tok(patch), "patch-json": tok(f"<tool_call>\n{shell}\n</tool_call>"), "fresh": tok(FRESH.read_text())}


def views_of(tok, prompt: list, name: str) -> list:
    """The views a request writing output `name` indexes: a patch's once it starts one."""
    views = PromptViews(tok)
    return views.first(prompt) + (views.for_patch(prompt, name.endswith("json"))
                                  if name.startswith("patch") else [])


def simulate(prompt: list, output: list, shared, max_len: int, knobs: dict, views=()) -> dict:
    """One request decoded with a perfect verifier: per cycle, the kept draft + one token."""
    d = SuffixDrafter(prompt, shared, views=views, **knobs)
    s = Counter()
    t_prop, t_app = [], []
    i = 0
    while i < len(output):
        best = float("inf")
        for _ in range(3):  # the least of 3: a busy machine's preemptions are not the cost
            t0 = time.perf_counter()
            draft = d.propose(max_len=max_len)
            best = min(best, time.perf_counter() - t0)
        t_prop.append(best)
        kept = 0
        while kept < len(draft.tokens) and i + kept < len(output) and draft.tokens[kept] == output[i + kept]:
            kept += 1
        step = output[i:i + kept + 1]
        t0 = time.perf_counter()
        for t in step:
            d.append(t)
        t_app.append((time.perf_counter() - t0) / len(step))
        i += len(step)
        s.update(cycles=1, drafted=len(draft.tokens), kept=kept, proposals=bool(draft.tokens))
        s["score"] += draft.score
    return dict(s, tokens=len(output), t_prop=t_prop, t_app=t_app)


def report(name: str, r: dict) -> None:
    n = max(1, r["proposals"])
    print(f"  {name:8s} {r['tokens']:5d} tok  {r['tokens'] / r['cycles']:5.2f} tok/cycle  "
          f"drafts in {r['proposals'] / r['cycles']:4.0%} of cycles, mean len {r['drafted'] / n:5.1f}  "
          f"acceptance {r['kept'] / max(1, r['drafted']):4.0%}  "
          f"score {r['score'] / n:5.2f} vs kept {r['kept'] / n:5.2f} per draft")


def _us(xs) -> str:
    xs = sorted(xs)
    return (f"mean {statistics.fmean(xs) * 1e6:6.1f} us  median {xs[len(xs) // 2] * 1e6:6.1f}  "
            f"p99 {xs[int(len(xs) * 0.99)] * 1e6:6.1f}  max {xs[-1] * 1e6:7.1f}")


def merge_cost(prompt: list) -> float:
    """The append that merges the unsorted tail into the sorted arrays, best of 5."""
    costs = []
    for _ in range(5):
        d = SuffixDrafter(prompt)
        d.extend(prompt[:d.index.live_max])
        t0 = time.perf_counter()
        d.append(prompt[0])
        costs.append(time.perf_counter() - t0)
    return min(costs)


def view_cost(text: str) -> dict:
    """The time of a request's first views and of its patch views, best of 3 each, over
    `text` in the demo's tokenizer (a Qwen BPE), capped at VIEW_TOKENS as a request's views are."""
    from transformers import AutoTokenizer  # only for this line of the report

    from mlxmtp.models.demo import PACKAGED

    real = AutoTokenizer.from_pretrained(str(PACKAGED))
    ids = real.encode(text)
    views, costs = PromptViews(real), {}
    for name, build in (("first", views.first), ("for_patch", lambda ids: views.for_patch(ids, True))):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            build(ids)
            times.append(time.perf_counter() - t0)
        costs[name] = min(times)
    return costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=30_000)
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--min-prob", type=float, default=0.1)
    ap.add_argument("--min-match", type=int, default=2)
    ap.add_argument("--max-match", type=int, default=32)
    ap.add_argument("--spec-factor", type=float, default=1.0)
    args = ap.parse_args()
    knobs = dict(min_prob=args.min_prob, min_match=args.min_match, max_match=args.max_match,
                 spec_factor=args.spec_factor)
    tok = Tokenizer()
    prompt, outs = agent_prompt(tok, args.prompt_tokens), outputs(tok)
    shared = SharedOutputs(min_match=args.min_match, max_match=args.max_match)
    for path in _files({TARGET, FRESH}):
        shared.add(tok(path.read_text()))
    builds = []
    for _ in range(5):
        t0 = time.perf_counter()
        d = SuffixDrafter(prompt)
        builds.append(time.perf_counter() - t0)
    print(f"prompt {len(prompt)} tokens; shared index {shared.tokens} tokens in {len(shared.chunks)} chunks")
    props, apps = {"own": [], "shared": []}, {"own": [], "shared": []}
    for label, sh in (("own", None), ("shared", shared)):
        print(f"{label} index (max_len {args.max_len}):")
        for name, out in outs.items():
            r = simulate(prompt, out, sh, args.max_len, knobs)
            report(name, r)
            if name.startswith(("edit", "patch")):
                report("+views", simulate(prompt, out, sh, args.max_len, knobs, views_of(tok, prompt, name)))
            props[label] += r["t_prop"]
            apps[label] += r["t_app"]
    listed = agent_prompt(tok, args.prompt_tokens, numbered)
    print("the file to edit read with its lines numbered (cat -n), own index:")
    for name in ("edit", "edit-json", "patch", "patch-json"):
        report(name, simulate(listed, outs[name], None, args.max_len, knobs))
        report("+views", simulate(listed, outs[name], None, args.max_len, knobs, views_of(tok, listed, name)))
    print(f"build ({len(prompt)} tokens): best {min(builds) * 1e3:.1f} ms, median "
          f"{statistics.median(builds) * 1e3:.1f} ms; {d.index.nbytes / d.index.tokens:.1f} bytes/token "
          f"(request index), {shared.nbytes / shared.tokens:.1f} bytes/token (shared)")
    print(f"merge of {d.index.live_max} appended tokens into it: best {merge_cost(prompt) * 1e3:.2f} ms")
    for label in props:
        print(f"propose, {label:6s}: {_us(props[label])}")
        print(f"append,  {label:6s}: {_us(apps[label])}")
    for label, p in (("", prompt), (" (file numbered)", listed)):
        costs = view_cost(tok.decode(p))
        print(f"views of the prompt{label} with the demo's tokenizer: first {costs['first'] * 1e3:.1f} ms, "
              f"for a patch {costs['for_patch'] * 1e3:.1f} ms")
    adds = []
    for _ in range(3):
        t0 = time.perf_counter()
        shared.add(outs["edit"])
        adds.append(time.perf_counter() - t0)
    print(f"shared.add of a {len(outs['edit'])}-token output (a request's end, merged into a "
          f"{shared.chunks[-1].tokens}-token chunk): best {min(adds) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
