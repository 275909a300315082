"""Anthropic Messages input -> the chat template's messages and tools (chat.py's form).

A user turn's tool results become `tool` messages (the template groups them into one
<tool_response> turn); assistant thinking becomes `reasoning_content` and tool_use blocks
`tool_calls`; tools become OpenAI-style function tools (what Qwen templates render).

Tool search (Claude Code defers most MCP tools and some of its own): a tool marked
`defer_loading` is left out of the tools the prompt lists, and its schema enters the
conversation where a `tool_reference` block in a tool result names it, as Anthropic's API
expands it. Claude Code adds each tool it loads to `tools` in the middle of the list; listed
there, it would change the prompt from the tools on and cost a whole conversation's prefill
per tool loaded. Calls to a deferred tool parse like any other.
"""

from __future__ import annotations

import json
import re
from itertools import groupby
from typing import Any, List, Optional

from .chat import Message, check_schema, left_out
from .errors import APIError


def _blocks(content: Any, where: str) -> List[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list) and all(isinstance(b, dict) for b in content):
        return content
    raise APIError(400, f"{where}: 'content' must be a string or an array of content blocks")


def _tool_result_text(content: Any, where: str, catalog: dict) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # A run of tool_reference blocks expands where it stands, into one <functions> block.
    runs = groupby(_blocks(content, where), key=lambda b: b.get("type") == "tool_reference")
    return "\n".join(loaded_schemas(list(run), catalog, where) if refs else
                     "\n".join(_block_text(b, where) for b in run) for refs, run in runs)


def loaded_schemas(refs: List[dict], catalog: dict, where: str) -> str:
    """What tool_reference blocks expand to: the named tools' schemas in a <functions>
    block, one <function> line each (the form Claude Code's ToolSearch tells the model to
    expect). catalog: name -> the request's function tool."""
    lines = []
    for ref in refs:
        name = ref.get("tool_name")
        if not isinstance(name, str):
            raise APIError(400, f"{where}: tool_reference blocks need a 'tool_name'")
        if name not in catalog:
            raise APIError(400, f"{where}: tool reference {name!r} not found in available tools")
        fn = catalog[name]["function"]
        schema = {"description": fn.get("description", ""), "name": name, "parameters": fn["parameters"]}
        lines.append(f"<function>{json.dumps(schema, ensure_ascii=False)}</function>")
    return "<functions>\n" + "\n".join(lines) + "\n</functions>"


def _string(b: dict, key: str, where: str) -> str:
    """A block's text field (`key`; absent: ""), which must be a string (a number or null would
    reach the prompt as its Python spelling)."""
    value = b.get(key, "")
    if not isinstance(value, str):
        raise APIError(400, f"{where}: a {b.get('type')} block's '{key}' must be a string")
    return value


def _block_text(b: dict, where: str) -> str:
    """What the model reads of a text, document or image block. The models served are
    text-only: an image or a PDF (a user's attachment, a picture a tool read) becomes a note
    that it was left out, so the turn (which an agent resends every turn) still runs."""
    kind = b.get("type")
    if kind == "text":
        return _string(b, "text", where)
    if kind in ("image", "document") and not isinstance(b.get("source"), dict):
        raise APIError(400, f"{where}: {kind} blocks need a 'source' object")
    text = _document_text(b.get("source")) if kind == "document" else None
    if text is None:
        return left_out(kind)
    return f"{b['title']}\n\n{text}" if isinstance(b.get("title"), str) and b["title"] else text


def _document_text(source: Any) -> Optional[str]:
    """A plain-text document's text (source type `text`, or `content` blocks); None otherwise."""
    if not isinstance(source, dict):
        return None
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        return source["data"]
    if source.get("type") == "content":
        inner = source.get("content")
        if isinstance(inner, str):
            return inner
        if isinstance(inner, list):
            return "\n".join(str(c.get("text", "")) for c in inner if isinstance(c, dict) and c.get("type") == "text")
    return None


def _joined(parts: List[tuple]) -> str:
    """A user turn's text: text blocks run together as sent; a document or a note stands on
    its own lines."""
    out = ""
    for i, (is_text, text) in enumerate(parts):
        if i and not (is_text and parts[i - 1][0]):
            out += "\n"
        out += text
    return out


# Claude Code puts a billing line first in `system` ("x-anthropic-billing-header: cc_version=
# ...; cch=...;"), different on every request. Anthropic's API reads it as metadata; left in
# the prompt it would change the first tokens of every request, so no conversation would
# ever reuse a cached prefix (its ~20-40K-token system prompt and tools prefilled each turn).
_BILLING_LINE = re.compile(r"\Ax-anthropic-billing-header:[^\n]*(\n|\Z)")


def anthropic_system(system: Any, where: str = "system") -> Optional[str]:
    if system is None:
        return None
    if isinstance(system, str):
        return _BILLING_LINE.sub("", system)
    texts = [_BILLING_LINE.sub("", _string(b, "text", where)) for b in _blocks(system, where) if b.get("type") == "text"]
    return "\n".join(t for t in texts if t)


def anthropic_messages(system: Any, messages: Any, tools: Optional[List[dict]] = None) -> List[Message]:
    """tools: the request's function tools (anthropic_tools), which tool_reference blocks name."""
    catalog = {t["function"]["name"]: t for t in tools or []}
    if not isinstance(messages, list):
        raise APIError(400, "messages: must be an array")
    if not messages:
        raise APIError(400, "messages: at least one message is required")
    out: List[Message] = []
    sys_text = anthropic_system(system)
    if sys_text:
        out.append({"role": "system", "content": sys_text})
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise APIError(400, f"{where}: must be an object")
        role = m.get("role")
        if role == "system":  # not in Anthropic's API, but clients send it: placed by render
            out.append({"role": "system", "content": anthropic_system(m.get("content"), where) or ""})
        elif role == "user":
            out += _anthropic_user(_blocks(m.get("content"), where), where, catalog)
        elif role == "assistant":
            out.append(_anthropic_assistant(_blocks(m.get("content"), where), where))
        else:
            raise APIError(400, f"{where}.role: must be 'user', 'assistant' or 'system', got {role!r}")
    if all(m["role"] == "system" for m in out):
        raise APIError(400, "messages: at least one user or assistant message is required")
    return out


def continues_prefill(msgs: List[Message], where: str) -> bool:
    """Whether the conversation ends with a prefilled answer to continue (Anthropic's
    prefill): a last assistant message with text and no tool call. As in Anthropic's API its
    text may not end in whitespace (the model's next token would carry it)."""
    last = msgs[-1]
    if last["role"] != "assistant" or last.get("tool_calls") or not last["content"]:
        return False
    if last["content"] != last["content"].rstrip():
        raise APIError(400, f"{where}: final assistant content cannot end with trailing whitespace")
    return True


def _anthropic_user(blocks: List[dict], where: str, catalog: dict) -> List[Message]:
    """A user turn -> its tool results as `tool` messages (the template groups them into
    one <tool_response> user turn), then its text as a user message."""
    out: List[Message] = []
    parts = []  # (is a text block, its text)
    for b in blocks:
        kind = b.get("type")
        if kind in ("text", "image", "document"):
            parts.append((kind == "text", _block_text(b, where)))
        elif kind == "tool_result":
            text = _tool_result_text(b.get("content"), where, catalog)
            if b.get("is_error"):
                text = "Error: " + text
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": text})
        else:
            raise APIError(400, f"{where}: content blocks of type {kind!r} are not supported")
    if parts or not any(b.get("type") == "tool_result" for b in blocks):
        out.append({"role": "user", "content": _joined(parts)})
    return out


def _anthropic_assistant(blocks: List[dict], where: str) -> Message:
    """An assistant turn: text, thinking as `reasoning_content`, tool_use as `tool_calls`."""
    texts, calls, thinking = [], [], []
    for b in blocks:
        kind = b.get("type")
        if kind == "text":
            texts.append(_string(b, "text", where))
        elif kind == "thinking":
            thinking.append(_string(b, "thinking", where))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if not isinstance(b.get("name"), str):
                raise APIError(400, f"{where}: tool_use blocks need a 'name'")
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b["name"], "arguments": b.get("input") or {}}})
        else:
            raise APIError(400, f"{where}: content blocks of type {kind!r} are not supported")
    msg: Message = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def anthropic_tools(tools: Any) -> Optional[List[dict]]:
    """Anthropic tools -> OpenAI-style function tools (what Qwen templates render)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools: must be an array")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise APIError(400, f"tools.{i}: each tool needs a 'name'")
        if "input_schema" not in t:
            continue  # server tools (web_search, ...) are not ours to run
        check_schema(t["input_schema"], f"tools.{i}.input_schema")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
        if not isinstance(t.get("description", ""), str):
            raise APIError(400, f"tools.{i}.description: must be a string")
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def listed_tools(tools: Any, functions: Optional[List[dict]], forced: Optional[str] = None) -> Optional[List[dict]]:
    """The function tools the prompt lists up front: those not marked `defer_loading` (all
    of them if every one is: the template then still says how to call a tool), and the tool
    `tool_choice` names (`forced`): the model sees the schema its call is held to."""
    deferred = {t["name"] for t in tools or [] if t.get("defer_loading") is True} - {forced}
    listed = [f for f in functions or [] if f["function"]["name"] not in deferred]
    return listed or functions
