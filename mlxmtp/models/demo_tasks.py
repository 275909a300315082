"""Copy and edit tasks for the demo model, as chat conversations: what coding agents do
most (print a file again with a name changed; an Edit tool call whose `old_string` is
copied from a file read earlier). The training script fine-tunes the demo on such tasks
built from its training files (scripts/finetune_demo_copy.py); `bench/decode.py --workload
rename|edit`, `bench/batch.py --workload agents` and that script's `measure` build them from
the held-out files (listed in demo_model/training.json).

Each task is (messages, tools, answer): the conversation up to the answer, the tool
schemas it offers, and the assistant message the model should write."""

from __future__ import annotations

import difflib
import json
import keyword
import os
import random
import re
from pathlib import Path

from .demo import PACKAGED

EDIT_TOOLS = [
    {"type": "function", "function": {
        "name": "Read", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"file_path": {"type": "string"}},
                       "required": ["file_path"]}}},
    {"type": "function", "function": {
        "name": "Edit", "description": "Replace old_string by new_string in a file.",
        "parameters": {"type": "object", "properties": {
            "file_path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"}},
            "required": ["file_path", "old_string", "new_string"]}}},
]
NEW_NAME_PARTS = ["value", "item", "entry", "result", "node", "data", "count", "name", "key", "part"]
_IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{2,}\b")
KINDS = ("repeat", "rename", "edit")
_BLOCK_START = re.compile(r"^(?:def|class|async def) ", re.M)


def code_snippet(text: str, rng: random.Random, max_chars: int = 600) -> str | None:
    """Whole lines of `text` from a top-level def or class on, at most `max_chars` long,
    ending before a blank line where one is near the end; None if the file has no block."""
    starts = [m.start() for m in _BLOCK_START.finditer(text)]
    if not starts:
        return None
    start = rng.choice(starts)
    cut = text[start:start + max_chars]
    cut = cut[: cut.rfind("\n") + 1] if "\n" in cut else ""
    blank = cut.rfind("\n\n")
    if blank > len(cut) // 2:
        cut = cut[: blank + 1]
    return cut if cut.count("\n") >= 3 else None


def pick_rename(code: str, rng: random.Random) -> tuple[str, str] | None:
    """(old, new): an identifier used at least twice in `code` and a name it does not use."""
    counts: dict[str, int] = {}
    for name in _IDENT.findall(code):
        if not keyword.iskeyword(name) and name not in ("self", "cls", "None", "True", "False"):
            counts[name] = counts.get(name, 0) + 1
    names = sorted(n for n, c in counts.items() if c >= 2)
    if not names:
        return None
    old = rng.choice(names)
    new = f"{old.rstrip('_')}_{rng.choice(NEW_NAME_PARTS)}"
    return (old, new) if new not in code else None


def renamed(code: str, old: str, new: str) -> str:
    return re.sub(rf"\b{re.escape(old)}\b", new, code)


def repeat_task(code: str):
    ask = f"Print this code again, exactly as it is:\n\n```python\n{code}```"
    return [{"role": "user", "content": ask}], None, {"role": "assistant", "content": f"```python\n{code}```"}


def rename_task(code: str, old: str, new: str):
    ask = f"Rename `{old}` to `{new}` in this code and print all of it:\n\n```python\n{code}```"
    answer = f"```python\n{renamed(code, old, new)}```"
    return [{"role": "user", "content": ask}], None, {"role": "assistant", "content": answer}


def _call(name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def edit_task(path: str, code: str, old: str, new: str):
    """The agent read `path` (whose text is `code`) and now renames `old` to `new` in it
    with one Edit call: `old_string` is the file's text, `new_string` the renamed text."""
    messages = [
        {"role": "user", "content": f"In {path}, rename `{old}` to `{new}`."},
        _call("Read", {"file_path": path}),
        {"role": "tool", "content": code},
    ]
    edit = {"file_path": path, "old_string": code, "new_string": renamed(code, old, new)}
    return messages, EDIT_TOOLS, _call("Edit", edit)


def random_task(path: str, text: str, rng: random.Random, max_chars: int = 600, kinds=KINDS):
    """A task of one of `kinds` (picked at random) on a snippet of `text`; None if the file
    has no snippet, or none with a name to change where the kind needs one."""
    code = code_snippet(text, rng, max_chars)
    if code is None:
        return None
    rename = pick_rename(code, rng)
    kind = rng.choice(kinds) if rename else "repeat"
    if kind == "repeat":
        return repeat_task(code) if "repeat" in kinds else None
    return rename_task(code, *rename) if kind == "rename" else edit_task(path, code, *rename)


def held_out_tasks(kind: str, n: int, max_chars: int = 400, seed: int = 7) -> list:
    """Up to `n` tasks of `kind`, one per held-out file of the demo's training split
    (demo_model/training.json) that this Python's standard library has."""
    stdlib = Path(os.__file__).resolve().parent
    rng, tasks = random.Random(seed), []
    for name in json.loads((PACKAGED / "training.json").read_text())["held_out_files"]:
        if (stdlib / name).is_file() and len(tasks) < n:
            task = random_task(name, (stdlib / name).read_text(errors="replace"), rng, max_chars, (kind,))
            tasks += [task] if task is not None else []
    return tasks


def render(tokenizer, task, with_answer: bool) -> str:
    """The task through the model's chat template: the prompt (with_answer False) or the
    whole conversation (True), as a server would render it."""
    messages, tools, answer = task
    if not with_answer:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer.apply_chat_template(messages + [answer], tools=tools, tokenize=False)


def answer_ids(tokenizer, task) -> list[int]:
    """The tokens the model should write for `task` (after its generation prompt)."""
    prompt = render(tokenizer, task, with_answer=False)
    return tokenizer.encode(render(tokenizer, task, with_answer=True)[len(prompt):])


def reproduced_share(want: list[int], got: list[int]) -> float:
    """Share of `want`'s tokens that `got` reproduces in order (difflib's matching blocks)."""
    matcher = difflib.SequenceMatcher(None, want, got, autojunk=False)
    return sum(b.size for b in matcher.get_matching_blocks()) / max(1, len(want))
