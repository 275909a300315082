r"""Other renderings of a prompt for the suffix drafter to draft from (issue 44).

An agent copies what it read, but not always as it read it:
- a tool call whose arguments are JSON (Hermes-style templates: Qwen3, Qwen3-Next) copies a
  file as a JSON string: every newline and quote escaped, so the copy matches the prompt
  only between two escapes, a line at most;
- a file read through an agent's Read tool comes back with its lines numbered (as `cat -n`
  does: Claude Code's `1\tline`, its older `     1→line`; OpenCode's `1: line`, its older
  `00001| line`), and the `old_string` of the Edit that follows copies the lines without
  their numbers: the copy matches a line at most again.

`prompt_views` renders the prompt's tail those ways and tokenizes each rendering; indexed
beside the prompt (suffix_index.SuffixDrafter's `views`), they let a draft run on across
lines. A view is never output. Drafts are verified like any other: a view that tokenizes
differently from what the model writes costs acceptance, never the text.

Written here: line numbers are a convention of the agents, not of any tokenizer or library.
"""

from __future__ import annotations

import json
import re
from typing import List

VIEW_TOKENS = 1 << 15  # the prompt's last tokens a view renders (built once a request; cost: BENCHMARKS.md)
MIN_RUN = 3  # consecutively numbered lines that make a numbered listing
_ESCAPED = ('"', "\\", "\n", "\t", "\r")
# A line's number and what separates it from the line: a tab, an arrow (and a tab), a bar
# (and a space), a colon and a space; none where the line is empty.
_NUMBER = re.compile(r" *(\d{1,7})(?:→\t?|\t|\| ?|: |(?=\r?\n|$))")


def json_string(text: str) -> str:
    """`text` written as a JSON string's inside (non-ASCII kept as is, as models write it)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def numbered_listings(text: str) -> List[str]:
    """The listings in `text` (runs of at least MIN_RUN lines numbered n, n+1, ...), each
    without its numbers."""
    listings, run, last = [], [], None
    for line in text.splitlines(keepends=True):
        m = _NUMBER.match(line)
        number = int(m.group(1)) if m else None
        if number is None or last is None or number != last + 1:
            if len(run) >= MIN_RUN:
                listings.append("".join(run))
            run = []
        if number is not None:
            run.append(line[m.end():])
        last = number
    if len(run) >= MIN_RUN:
        listings.append("".join(run))
    return listings


def prompt_views(tokenizer, prompt: List[int]) -> List[List[int]]:
    """The prompt's last VIEW_TOKENS tokens as a JSON string, its numbered listings without
    their numbers, raw and as JSON strings: each tokenized, none where it changes nothing."""
    text = tokenizer.decode(list(prompt[-VIEW_TOKENS:]))
    listings = numbered_listings(text)
    texts = [json_string(t) for t in [text, *listings] if any(c in t for c in _ESCAPED)]
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in [*listings, *texts] if t]

