"""Where each token of a copy task's answer was copied from, for the attention targets of
scripts/finetune_demo_copy.py.

Matching the last few tokens against earlier text (that script's `induction_targets`) finds
no target where the copy is not written as its source was: after a renamed name the last
tokens occur nowhere before, and an Edit call's `old_string` is the file JSON-escaped, so it
matches the file it was read from only between escapes. A task knows what its answer copies
(mlxmtp/models/demo_tasks.py builds it), so here each answer character is traced to the
source character it was written from, through the rename (difflib's matching blocks) and the
escaping (each character's own `json.dumps`), and each answer token gets as target the source
token holding the character the next answer token starts with.
"""

from __future__ import annotations

import difflib
import json

import numpy as np

FENCE = "```python\n"


def escaped(text: str) -> tuple[str, list[int]]:
    """`text` as the body of a JSON string (json.dumps's, ASCII), and for each of its
    characters the index of the character of `text` it writes."""
    parts, index = [], []
    for i, ch in enumerate(text):
        part = json.dumps(ch)[1:-1]
        parts.append(part)
        index += [i] * len(part)
    return "".join(parts), index


def aligned(source: str, copy: str) -> list[int | None]:
    """For each character of `copy`, the index of the character of `source` it copies
    (difflib's matching blocks), None for what the copy adds."""
    out: list[int | None] = [None] * len(copy)
    for a, b, n in difflib.SequenceMatcher(None, source, copy, autojunk=False).get_matching_blocks():
        out[b:b + n] = range(a, a + n)
    return out


def _fenced(content: str) -> str:
    return content.split(FENCE, 1)[1][:-3]


def char_sources(text: str, prompt_len: int, task) -> dict[int, int]:
    """{character of the answer in `text`: the character of `text` it copies}, for a task
    rendered whole as `text` whose prompt is its first `prompt_len` characters."""
    messages, tools, answer = task
    if tools is None:  # repeat or rename: the ask's code block, printed back in the answer
        code, out = _fenced(messages[-1]["content"]), _fenced(answer["content"])
        src, dst = text.index(FENCE + code) + len(FENCE), text.index(FENCE + out, prompt_len) + len(FENCE)
        return {dst + j: src + i for j, i in enumerate(aligned(code, out)) if i is not None}
    # edit: old_string copies the file the Read call returned, new_string copies old_string
    arguments = json.loads(answer["tool_calls"][0]["function"]["arguments"])
    code = messages[-1]["content"]
    old, old_index = escaped(arguments["old_string"])
    new, _ = escaped(arguments["new_string"])
    src = text.index(code)
    at_old = text.index(old, prompt_len)
    at_new = text.index(new, at_old + len(old))
    sources = {at_old + j: src + i for j, i in enumerate(old_index)}
    sources.update({at_new + j: at_old + i for j, i in enumerate(aligned(old, new)) if i is not None})
    return sources


def token_targets(offsets: list, sources: dict[int, int]) -> dict[int, int]:
    """{token position: the position of the token it should copy next}: for each token after
    the first whose first character was copied, the token holding that character's source,
    as target of the token before it (which predicts it)."""
    end = max((e for _, e in offsets), default=0)
    owner = np.full(end + 1, -1, dtype=np.int64)
    for t, (s, e) in enumerate(offsets):
        owner[s:e] = t
    targets = {}
    for u in range(1, len(offsets)):
        source = sources.get(offsets[u][0])
        if source is not None and 0 <= owner[source] < u:
            targets[u - 1] = int(owner[source])
    return targets
