"""Anthropic Messages input -> the chat template's messages and tools (chat.py's form).

A user turn's tool results become `tool` messages (the template groups them into one
<tool_response> turn); assistant thinking becomes `reasoning_content` and tool_use blocks
`tool_calls`; tools become OpenAI-style function tools (what Qwen templates render).
"""

from __future__ import annotations

from typing import Any, List, Optional

from .chat import Message
from .errors import APIError


def _blocks(content: Any, where: str) -> List[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list) and all(isinstance(b, dict) for b in content):
        return content
    raise APIError(400, f"{where}: 'content' must be a string or an array of content blocks")


def _tool_result_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for b in _blocks(content, where):
        if b.get("type") == "text":
            texts.append(str(b.get("text", "")))
        else:  # an image a tool returned (Claude Code's Read of a picture): say so, keep the turn
            texts.append(f"[{b.get('type')} omitted: this server reads text only]")
    return "\n".join(texts)


def anthropic_system(system: Any, where: str = "system") -> Optional[str]:
    if system is None:
        return None
    if isinstance(system, str):
        return system
    return "\n".join(str(b.get("text", "")) for b in _blocks(system, where) if b.get("type") == "text")


def anthropic_messages(system: Any, messages: Any) -> List[Message]:
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
            out += _anthropic_user(_blocks(m.get("content"), where), where)
        elif role == "assistant":
            out.append(_anthropic_assistant(_blocks(m.get("content"), where), where))
        else:
            raise APIError(400, f"{where}.role: must be 'user', 'assistant' or 'system', got {role!r}")
    if all(m["role"] == "system" for m in out):
        raise APIError(400, "messages: at least one user or assistant message is required")
    return out


def _anthropic_user(blocks: List[dict], where: str) -> List[Message]:
    """A user turn -> its tool results as `tool` messages (the template groups them into
    one <tool_response> user turn), then its text as a user message."""
    out: List[Message] = []
    texts = []
    for b in blocks:
        kind = b.get("type")
        if kind == "text":
            texts.append(str(b.get("text", "")))
        elif kind == "tool_result":
            text = _tool_result_text(b.get("content"), where)
            if b.get("is_error"):
                text = "Error: " + text
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": text})
        else:
            raise APIError(400, f"{where}: content blocks of type {kind!r} are not supported")
    if texts or not any(b.get("type") == "tool_result" for b in blocks):
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _anthropic_assistant(blocks: List[dict], where: str) -> Message:
    """An assistant turn: text, thinking as `reasoning_content`, tool_use as `tool_calls`."""
    texts, calls, thinking = [], [], []
    for b in blocks:
        kind = b.get("type")
        if kind == "text":
            texts.append(str(b.get("text", "")))
        elif kind == "thinking":
            thinking.append(str(b.get("thinking", "")))
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
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None
