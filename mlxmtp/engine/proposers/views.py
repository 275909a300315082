r"""Other renderings of a prompt for the suffix drafter to draft from (issue 44).

An agent copies what it read, but not always as it read it:
- a tool call whose arguments are JSON (Hermes-style templates: Qwen3, Qwen3-Next) copies a
  file as a JSON string: every newline and quote escaped, so the copy matches the prompt
  only between two escapes, a line at most;
- a file read through an agent's Read tool comes back with its lines numbered (as `cat -n`
  does: Claude Code's `1\tline`, its older `     1→line`; OpenCode's `1: line`, its older
  `00001| line`), and the `old_string` of the Edit that follows copies the lines without
  their numbers: the copy matches a line at most again;
- a patch (Codex's apply_patch, a unified diff) copies the lines it keeps and removes behind
  a mark, " " or "-".

`PromptViews` renders the prompt's tail those ways and tokenizes each rendering (the patch's
only once a row's output starts one, raw or JSON-escaped as the output is: two renderings of
every line are too dear to build for every request). Indexed beside the prompt
(suffix_index.SuffixDrafter's `views`), they let a draft run on across lines. A view is never
output. Drafts are verified like any other: a view that tokenizes differently from what the
model writes costs acceptance, never the text.

Written here: line numbers are a convention of the agents, not of any tokenizer or library.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from typing import List, Optional, Tuple

log = logging.getLogger("mlxmtp")

VIEW_TOKENS = 1 << 15  # the prompt's last tokens a view renders (built once a request; cost: BENCHMARKS.md)
MIN_RUN = 3  # consecutively numbered lines that make a numbered listing
_ESCAPED = ('"', "\\", "\n", "\t", "\r")
PATCH_MARKS = ("@@", "*** Update File")  # a hunk's header; the file header of Codex's apply_patch
# A line's number and what separates it from the line: a tab, an arrow (and a tab), a bar
# (and a space), a colon and a space; none where the line is empty.
_NUMBER = re.compile(r" *(\d{1,7})(?:→\t?|\t|\| ?|: |(?=\r?\n|$))")


def json_string(text: str) -> str:
    """`text` written as a JSON string's inside (non-ASCII kept as is, as models write it)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _listings(lines: List[str]) -> List[Tuple[int, List[str]]]:
    """(index of its first line, its lines without their numbers) for each run of at least
    MIN_RUN lines numbered n, n+1, ..."""
    found, run, last = [], [], None
    for i, line in enumerate(lines + [""]):  # "" ends the last run
        m = _NUMBER.match(line) if i < len(lines) else None
        number = int(m.group(1)) if m else None
        if number is None or last is None or number != last + 1:
            if len(run) >= MIN_RUN:
                found.append((i - len(run), run))
            run = []
        if number is not None:
            run.append(line[m.end():])
        last = number
    return found


def numbered_listings(text: str) -> List[str]:
    """The listings in `text`, each without its numbers."""
    return ["".join(run) for _, run in _listings(text.splitlines(keepends=True))]


def unnumbered(text: str) -> str:
    """`text` with its listings' numbers taken off in place."""
    lines = text.splitlines(keepends=True)
    for start, run in _listings(lines):
        lines[start:start + len(run)] = run
    return "".join(lines)


def marked(text: str, mark: str) -> str:
    """Every line of `text` behind `mark`, as a patch writes the lines it keeps (" ") or
    removes ("-")."""
    return "".join(mark + line for line in text.splitlines(keepends=True))


def _optional(default):
    """A view only speeds drafting up: where rendering one raises (a tokenizer's own error),
    the request drafts without it, and the server logs why once, not every cycle."""
    def wrap(method):
        @functools.wraps(method)
        def run(self, *args):
            try:
                return method(self, *args)
            except Exception as e:  # noqa: BLE001 - any error here costs speed, never a request
                if method.__name__ not in self.failed:
                    self.failed.add(method.__name__)
                    log.warning("suffix drafts: %s of a prompt failed (%s: %s); drafting without it",
                                method.__name__, type(e).__name__, e)
                return default
        return run
    return wrap


class PromptViews:
    """The renderings of a request's prompt that its suffix drafter indexes: `first`, built
    when the request starts; `for_patch`, once its output starts a patch (`patch_start`), whose
    kept and removed lines copy the file's lines behind a mark (Codex's apply_patch, a unified
    diff). Each rendering is of the prompt's last VIEW_TOKENS tokens, tokenized."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.failed: set = set()  # the methods that have raised (logged once each)

    def _tokens(self, texts: List[str]) -> List[List[int]]:
        return [list(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts if t]

    def _text(self, prompt: List[int]) -> str:
        return self.tokenizer.decode(list(prompt[-VIEW_TOKENS:]))

    @_optional([])
    def first(self, prompt: List[int]) -> List[List[int]]:
        """The prompt as a JSON string, its listings without their numbers, raw and as JSON
        strings; none where it changes nothing."""
        text = self._text(prompt)
        listings = numbered_listings(text)
        return self._tokens([*listings, *(json_string(t) for t in [text, *listings] if any(c in t for c in _ESCAPED))])

    @_optional(None)
    def patch_start(self, tokens: List[int]) -> Optional[bool]:
        """None where `tokens` (a row's latest, with a few before them) hold no patch mark;
        else whether the patch is written as a JSON string (its mark follows an escaped line
        end, where a raw patch's follows a line end)."""
        text = self.tokenizer.decode(list(tokens))
        found = [text.find(m) for m in PATCH_MARKS if m in text]
        return text[:min(found)].endswith("\\n") if found else None

    @_optional([])
    def for_patch(self, prompt: List[int], escaped: bool) -> List[List[int]]:
        """Every line of the prompt (listings without their numbers) behind " " and behind
        "-", as JSON strings if `escaped`."""
        texts = [marked(unnumbered(self._text(prompt)), mark) for mark in (" ", "-")]
        return self._tokens([json_string(t) for t in texts] if escaped else texts)
