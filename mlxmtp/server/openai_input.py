"""The request side of /v1/chat/completions: OpenAI chat `messages` and `tools` -> the
chat template's messages and tools (chat.py renders them; openai_api.py is the endpoint)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .chat import Message, check_schema, left_out, tool_arguments
from .errors import APIError

_MEDIA_PARTS = ("image_url", "input_audio", "file")


def _text_of(content: Any, where: str) -> str:
    """OpenAI content: a string, null, or a list of parts (text only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                if not isinstance(part.get("text"), str):
                    raise APIError(400, f"{where}: a text part needs a string 'text'", param="messages")
                texts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") in _MEDIA_PARTS:
                kind = part["type"]
                if not isinstance(part.get(kind), dict):
                    raise APIError(400, f"{where}: a {kind} part needs a '{kind}' object", param="messages")
                texts.append(left_out(kind))
            elif isinstance(part, dict):
                raise APIError(400, f"{where}: content parts of type {part.get('type')!r} are not supported "
                                    "(text only)", param="messages")
            else:
                raise APIError(400, f"{where}: invalid content part", param="messages")
        return "".join(texts)
    raise APIError(400, f"{where}: 'content' must be a string or an array of parts", param="messages")


def openai_messages(messages: Any) -> List[Message]:
    if not isinstance(messages, list):
        raise APIError(400, "'messages' must be an array", param="messages")
    if not messages:
        raise APIError(400, "'messages' must not be empty", param="messages")
    out: List[Message] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"{where} must be an object", param="messages")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise APIError(400, f"{where}: invalid role {role!r}", param="messages")
        msg: Message = {"role": role, "content": _text_of(m.get("content"), where)}
        if role == "assistant":
            if isinstance(m.get("reasoning_content"), str):
                msg["reasoning_content"] = m["reasoning_content"]
            calls = m.get("tool_calls")
            if calls:
                if not isinstance(calls, list):
                    raise APIError(400, f"{where}: 'tool_calls' must be an array", param="messages")
                msg["tool_calls"] = []
                for c in calls:
                    fn = c.get("function") if isinstance(c, dict) else None
                    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                        raise APIError(400, f"{where}: each tool call needs function.name", param="messages")
                    msg["tool_calls"].append({"id": c.get("id"), "type": "function", "function": {
                        "name": fn["name"], "arguments": tool_arguments(fn.get("arguments"))}})
        if role == "tool":
            if m.get("tool_call_id") is not None:
                msg["tool_call_id"] = m["tool_call_id"]
            if m.get("name") is not None:
                msg["name"] = m["name"]
        out.append(msg)
    return out


def openai_tools(tools: Any) -> Optional[List[dict]]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be an array", param="tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                           param="tools")
        check_schema(fn.get("parameters"), f"tools[{i}].function.parameters", param="tools")
        if not isinstance(fn.get("strict", False), (bool, type(None))):
            raise APIError(400, f"'tools[{i}].function.strict' must be a boolean", param=f"tools[{i}].function.strict")
    return tools or None


def strict_tools(tools: Optional[List[dict]]) -> Dict[str, str]:
    """The names of the functions marked `strict: true` -> where their parameters are (the
    field a schema llguidance cannot hold is a 400 on: call_hold.check_strict)."""
    return {t["function"]["name"]: f"tools[{i}].function.parameters"
            for i, t in enumerate(tools or []) if t["function"].get("strict") is True}
