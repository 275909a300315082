"""Streaming splitter: generated text -> content, reasoning and tool calls.

Text arrives in arbitrary pieces (a tag can be split across engine events), so the
splitter holds back any tail that could still become `<think>`, `</think>`,
`<tool_call>` or `</tool_call>`, and newlines that would only pad a section boundary
(the templates write `<think>\n`, `\n</think>\n\n` and `\n<tool_call>`, and strip
those newlines again when a turn comes back). Spaces are never dropped: an indented
first line of code keeps its indentation, and text cut by a stop string ends as it did.
Tags never reach the client: `<think>...</think>` becomes reasoning, and a complete
`<tool_call>...</tool_call>` becomes one parsed call (or, if it does not parse, plain
content so nothing is lost).

When the prompt's generation prefix already opened `<think>` (Qwen3.5/3.6 with
enable_thinking), the output starts inside the reasoning: `in_thinking=True`. When the
server ended the prompt with the opening of a forced tool call, `emitted` is that text:
it is parsed as if the model had written it, so the call it starts comes back whole.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from .tool_parsers import TOOL_CALL_END, TOOL_CALL_START, ToolParseError, parse_tool_call

THINK_START = "<think>"
THINK_END = "</think>"

Piece = Tuple[str, Any]  # ("content", str) | ("reasoning", str) | ("tool_call", {"name", "arguments"})


def starts_in_thinking(prompt_text: str) -> bool:
    """True when the rendered prompt leaves a `<think>` open (generation starts inside it)."""
    opened = prompt_text.rfind(THINK_START)
    return opened >= 0 and opened > prompt_text.rfind(THINK_END)


class OutputSplitter:
    def __init__(self, *, in_thinking: bool = False, parse_tools: bool = True,
                 tools: Optional[List[dict]] = None, emitted: str = ""):
        self.mode = "reasoning" if in_thinking else "content"
        self.parse_tools = parse_tools
        self.tools = tools
        self.buf = ""
        self.tool_body = ""
        self.lstrip = True  # drop newlines at the start of a section
        self.any_content = False
        if emitted:
            self.feed(emitted)  # "<tool_call>\n...": switches to the call, yields no piece of its own

    def _tags(self) -> List[str]:
        if self.mode == "reasoning":
            return [THINK_END]
        if self.mode == "tool":
            return [TOOL_CALL_END]
        # Qwen models reason only before the answer: once content has started, a literal
        # "<think>" (an agent writing about the tag) is just text.
        tags = [] if self.any_content else [THINK_START, THINK_END]
        if self.parse_tools:
            tags.append(TOOL_CALL_START)
        return tags

    def feed(self, text: str) -> List[Piece]:
        out: List[Piece] = []
        self.buf += text
        while True:
            tags = self._tags()
            hits = [(self.buf.find(t), t) for t in tags]
            hits = [h for h in hits if h[0] >= 0]
            if not hits:
                break
            i, tag = min(hits)
            self._emit(out, self.buf[:i], final=True)
            self.buf = self.buf[i + len(tag):]
            self._switch(out, tag)
        # No complete tag left: emit what cannot be the start of one.
        hold = _partial_tag_len(self.buf, self._tags())
        if self.mode == "tool":
            self.tool_body += self.buf[: len(self.buf) - hold]
            self.buf = self.buf[len(self.buf) - hold:]
            return out
        head = self.buf[: len(self.buf) - hold]
        # Trailing newlines may be the padding before a tag: keep them until text follows.
        keep = len(head) - len(head.rstrip("\n"))
        self._emit(out, head[: len(head) - keep], final=False)
        self.buf = self.buf[len(head) - keep:]
        return out

    def finish(self) -> List[Piece]:
        out: List[Piece] = []
        if self.mode == "tool":
            self.tool_body += self.buf
            self.buf = ""
            # A call cut off by EOS / max_tokens before `</tool_call>`: keep it if it parses.
            self._close_tool(out, closed=False)
        else:
            self._emit(out, self.buf, final=self.mode == "reasoning")
            self.buf = ""
        return _merge(out)

    # ------------------------------------------------------------------ internals
    def _emit(self, out: List[Piece], text: str, *, final: bool) -> None:
        if self.mode == "tool":
            self.tool_body += text
            return
        if self.lstrip:
            text = text.lstrip("\n")
            if text:
                self.lstrip = False
        if final:
            text = text.rstrip("\n")
        if text:
            if self.mode == "content":
                self.any_content = True
            _append(out, self.mode, text)

    def _switch(self, out: List[Piece], tag: str) -> None:
        if tag == THINK_START:
            self.mode = "reasoning"
        elif tag == THINK_END:
            # A stray `</think>` in content (template opened the block without us
            # knowing) just closes nothing; either way the tag is dropped.
            self.mode = "content"
        elif tag == TOOL_CALL_START:
            self.mode, self.tool_body = "tool", ""
        elif tag == TOOL_CALL_END:
            self._close_tool(out, closed=True)
            self.mode = "content"
        self.lstrip = True

    def _close_tool(self, out: List[Piece], *, closed: bool) -> None:
        body, self.tool_body = self.tool_body, ""
        try:
            out.append(("tool_call", parse_tool_call(body, self.tools)))
        except ToolParseError:
            raw = TOOL_CALL_START + body + (TOOL_CALL_END if closed else "")
            self.mode = "content"
            self.lstrip = False
            _append(out, "content", raw)


def _append(out: List[Piece], kind: str, text: str) -> None:
    if out and out[-1][0] == kind and kind != "tool_call":
        out[-1] = (kind, out[-1][1] + text)
    else:
        out.append((kind, text))


def _merge(pieces: List[Piece]) -> List[Piece]:
    out: List[Piece] = []
    for kind, value in pieces:
        if kind == "tool_call":
            out.append((kind, value))
        else:
            _append(out, kind, value)
    return out


def _partial_tag_len(text: str, tags: List[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a tag."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def split_all(text: str, **kwargs) -> List[Piece]:
    """Non-streaming convenience: the whole output at once."""
    sp = OutputSplitter(**kwargs)
    return _merge(sp.feed(text) + sp.finish())
