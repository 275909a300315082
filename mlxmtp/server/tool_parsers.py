"""Tool-call parsers for the Qwen3 family, written here rather than taken from mlx-lm.

mlx-lm has both formats (`mlx_lm/tool_parsers/json_tools.py`, `qwen3_coder.py`), but
its tokenizer picks ONE per model from the chat template, while fine-tunes and
Qwen3.5/3.6 checkpoints can emit either; trying both on every call is cheap and
robust. Both live inside `<tool_call>...</tool_call>`:

* Hermes JSON:   `{"name": "f", "arguments": {...}}`
* Qwen3-Coder:   `<function=f><parameter=a>value</parameter></function>`; values are
  raw text, typed with the tool's JSON schema when one is given.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional

from . import json_depth

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)


class ToolParseError(ValueError):
    pass


def parse_tool_call(body: str, tools: Optional[List[dict]] = None) -> Dict[str, Any]:
    """The text between `<tool_call>` and `</tool_call>` -> {"name": str, "arguments": dict}.
    Arguments nested deeper than json_depth.MAX_DEPTH are not a call: no reply could hold them."""
    text = body.strip()
    try:
        call = _parse_xml(text, tools) if text.startswith("<function=") else _parse_json(text)
    except RecursionError as e:
        raise ToolParseError("tool call nested too deeply to parse") from e
    if json_depth.depth(call["arguments"]) > json_depth.MAX_DEPTH:
        raise ToolParseError(f"tool call arguments nested deeper than {json_depth.MAX_DEPTH} levels")
    return call


def _parse_json(text: str) -> Dict[str, Any]:
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ToolParseError(f"tool call is not valid JSON: {e}") from e
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolParseError("tool call JSON has no 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models double-encode
        try:
            args = json.loads(args)
        except ValueError as e:
            raise ToolParseError("tool call arguments are not a JSON object") from e
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ToolParseError("tool call arguments are not a JSON object")
    return {"name": obj["name"], "arguments": args}


def _parse_xml(text: str, tools: Optional[List[dict]]) -> Dict[str, Any]:
    m = _FUNCTION.search(text)
    if m is None:
        raise ToolParseError("no <function=...> in tool call")
    name = m.group(1).strip()
    schema = _properties(name, tools)
    args: Dict[str, Any] = {}
    for pm in _PARAMETER.finditer(m.group(2)):
        value = pm.group(2)
        # The format puts each value on its own lines: drop exactly one newline each side.
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        key = pm.group(1).strip()
        args[key] = _convert(value, schema.get(key))
    return {"name": name, "arguments": args}


def _properties(name: str, tools: Optional[List[dict]]) -> dict:
    for tool in tools or []:
        fn = tool.get("function", tool)  # OpenAI wraps in "function"; Anthropic does not
        if fn.get("name") == name:
            params = fn.get("parameters") or fn.get("input_schema") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}


def schema_type(schema: Any) -> str:
    """A parameter's JSON-schema type, lower case; "" when the schema names none (or is
    not an object: `true`, or whatever a client sent)."""
    kind = schema.get("type", "") if isinstance(schema, dict) else ""
    if isinstance(kind, list):  # ["string", "null"]: the non-null one
        kind = next((k for k in kind if k != "null"), "")
    return str(kind).lower()


RAW_TYPES = ("string", "str", "text", "enum", "")  # parameters _convert keeps as raw text (or may)


def _convert(value: str, schema: Any) -> Any:
    kind = schema_type(schema)
    if kind in ("string", "str", "text", "enum"):
        return value
    if value.strip().lower() == "null":
        return None
    if kind in ("boolean", "bool"):
        return value.strip().lower() == "true"
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    if not kind:
        # Untyped (no schema): only structured values are decoded, like mlx-lm does; a
        # "42" meant as a file name stays a string.
        return parsed if isinstance(parsed, (dict, list)) else value
    return parsed
