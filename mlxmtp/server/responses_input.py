"""The request side of /v1/responses: its body -> the chat messages of
chat.py's shape (responses_api.py has the overview and the output side).

`instructions` and system/developer messages become system messages (chat.place_system
merges the leading ones and places a later one where the template takes it), `message`
items turns, `function_call` items an assistant turn's `tool_calls`,
`function_call_output` items `tool` messages, and a `reasoning` item the next assistant
turn's `reasoning_content`; items of tools that cannot run here (custom, local shell,
hosted search) are taken as history. Its `tools`: responses_tools.py.
"""

from __future__ import annotations

from typing import List, Optional

from .chat import effort_thinking, left_out, tool_arguments
from .responses_fields import bad, string_field
from .responses_tools import Tools
from .validation import field, top_logprobs

_SUMMARIES = ("auto", "concise", "detailed", "none")
_TEXT_PARTS = ("input_text", "output_text", "text")
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")
_STATELESS = ("this server keeps no conversation state (nothing is stored): send the whole conversation "
              "in 'input' instead of '{}'")


# ------------------------------------------------------------------ input -> chat messages
def _text(content, where: str, *, tool_output: bool = False) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"'{where}' must be a string or an array of content parts", where)
    texts = []
    for j, part in enumerate(content):
        pw = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise bad(f"'{pw}' must be a content part object", pw)
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise bad(f"'{pw}.text' must be a string", f"{pw}.text")
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in _MEDIA_PARTS or (tool_output and isinstance(kind, str)):
            texts.append(left_out(kind))
        else:
            raise bad(f"'{pw}.type' {kind!r} is not supported (text parts only: input_text, output_text)",
                       f"{pw}.type")
    return "".join(texts)


def _reasoning_text(item: dict, where: str) -> str:
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise bad(f"'{where}.{key}' must be an array", f"{where}.{key}")
        texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if texts:
            return "\n".join(texts)
    return ""


def input_messages(body: dict, tools: Tools) -> List[dict]:
    """`instructions` + `input` -> chat messages. System and developer messages stay system
    messages where they are: render (chat.place_system) merges the leading ones into the
    system prompt and places a later one as the template allows."""
    instructions = field(body, "instructions", str)
    turns = _Turns(tools)
    if instructions:
        turns.messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(_input_items(body)):
        turns.add(item, f"input[{i}]")
    if not any(m["role"] != "system" for m in turns.messages):
        raise bad("'input' has no user, assistant or tool turn", "input")
    return turns.messages


def _input_items(body: dict) -> List:
    """`input`: a string (one user message) or a non-empty array of items."""
    raw = body.get("input")
    if raw is None:
        raise bad("'input' is a required field", "input")
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad("'input' must be a string or a non-empty array of input items", "input")
    return raw


class _Turns:
    """Input items -> chat messages, one item at a time. A reasoning item waits for the
    assistant turn it belongs to (the next one)."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.messages: List[dict] = []
        self.reasoning: List[str] = []

    def add(self, item, where: str) -> None:
        if not isinstance(item, dict):
            raise bad(f"'{where}' must be an input item object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(item, where)
        elif kind == "function_call":
            self._function_call(item, where)
        elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            self._function_call_output(item, where)
        elif kind == "custom_tool_call":  # a freeform tool's call (Codex's apply_patch): its text input
            self._call(string_field(item, "call_id", where), string_field(item, "name", where),
                       {"input": string_field(item, "input", where)})
        elif kind == "local_shell_call":
            self._call(string_field(item, "call_id", where), "local_shell", item.get("action") or {})
        elif kind == "web_search_call":
            pass  # a hosted search another server ran: its results are not in the input
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if text:
                self.reasoning.append(text)
        else:
            raise bad(f"'{where}.type' {kind!r} is not supported (message, reasoning, function_call, "
                      "custom_tool_call, local_shell_call and their outputs, web_search_call)", f"{where}.type")

    def _assistant(self, content: str) -> dict:
        msg = {"role": "assistant", "content": content}
        if self.reasoning:
            msg["reasoning_content"] = "\n".join(self.reasoning)
            self.reasoning.clear()
        self.messages.append(msg)
        return msg

    def _message(self, item: dict, where: str) -> None:
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad(f"'{where}.role' must be 'user', 'assistant', 'system' or 'developer', got {role!r}",
                      f"{where}.role")
        if "content" not in item:
            raise bad(f"'{where}.content' is a required field", f"{where}.content")
        text = _text(item["content"], f"{where}.content")
        if role in ("system", "developer"):
            self.messages.append({"role": "system", "content": text})
        elif role == "assistant":
            self._assistant(text)
        else:
            self.messages.append({"role": "user", "content": text})

    def _function_call(self, item: dict, where: str) -> None:
        """A call joins the assistant turn before it, or opens one (also when reasoning waits)."""
        call_id = string_field(item, "call_id", where)
        name = string_field(item, "name", where)
        args = item.get("arguments")
        if not isinstance(args, str):
            raise bad(f"'{where}.arguments' must be a JSON string", f"{where}.arguments")
        namespace = string_field(item, "namespace", where, required=False)
        self._call(call_id, self.tools.shown_name(namespace, name), tool_arguments(args))

    def _call(self, call_id: str, name: str, arguments) -> None:
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self.reasoning:
            last = self._assistant("")
        last.setdefault("tool_calls", []).append(call)

    def _function_call_output(self, item: dict, where: str) -> None:
        # A local shell call's output names its call by `id`, the others by `call_id`.
        call_id = string_field(item, "call_id" if "call_id" in item or "id" not in item else "id", where)
        if "output" not in item:
            raise bad(f"'{where}.output' is a required field", f"{where}.output")
        output = _text(item["output"], f"{where}.output", tool_output=True)
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})


def thinking_flag(state, body: dict) -> Optional[bool]:
    """reasoning.effort 'none' / 'minimal' -> thinking off, other efforts on, where the
    chat template has enable_thinking; otherwise the template's default."""
    reasoning = field(body, "reasoning", dict)
    if reasoning is None:
        return None
    effort = field(reasoning, "effort", str, label="reasoning.effort")
    summary = field(reasoning, "summary", str, label="reasoning.summary")
    if summary is not None and summary not in _SUMMARIES:
        raise bad(f"'reasoning.summary' must be one of {', '.join(_SUMMARIES)}, got {summary!r}",
                   "reasoning.summary")
    return effort_thinking(state.tok, effort, "reasoning.effort")


def check_accepted(body: dict) -> None:
    """Fields accepted and ignored still get their type checked; state is refused."""
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise bad(_STATELESS.format(name), name)
    if field(body, "background", bool):
        raise bad("background responses are not supported (nothing is stored to poll)", "background")
    if body.get("prompt") is not None:
        raise bad("stored prompt templates ('prompt') are not supported; send 'instructions' and 'input'", "prompt")
    for name, kind in (("store", bool), ("metadata", dict), ("user", str), ("parallel_tool_calls", bool),
                       ("text", dict), ("max_tool_calls", int), ("prompt_cache_key", str),
                       ("service_tier", str), ("safety_identifier", str), ("stream_options", dict)):
        field(body, name, kind)
    top_logprobs(body)
    truncation = field(body, "truncation", str)
    if truncation is not None and truncation not in ("auto", "disabled"):
        raise bad(f"'truncation' must be 'auto' or 'disabled', got {truncation!r}", "truncation")
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(s, str) for s in include)):
        raise bad("'include' must be an array of strings", "include")
