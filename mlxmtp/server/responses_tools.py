"""The `tools` and `tool_choice` of a /v1/responses request -> the function tools the
chat template renders (responses_api.py has the overview).

`function` tools are flat (`name`, `parameters` at the top level); a `namespace` tool's
functions are flattened for the chat template, and `Tools` maps a called name back to its
namespace. Hosted tools (web_search, file_search, code_interpreter, ...) and freeform
`custom` tools cannot run here: they are left out with a warning for the response header.
A type the Responses API does not define is a 400 naming `tools[i].type`, as OpenAI answers.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Dict, List, Optional, Tuple

from .chat import check_schema
from .responses_fields import bad, string_field

# The Responses API's tool types that do not run here: the openai SDK's `Tool` union,
# less function and namespace.
HOSTED_TOOLS = frozenset({
    "apply_patch", "code_interpreter", "computer", "computer_use_preview", "custom", "file_search",
    "image_generation", "local_shell", "mcp", "programmatic_tool_calling", "shell", "tool_search",
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
})
TOOL_TYPES = HOSTED_TOOLS | {"function", "namespace"}
_NAMESPACED_TYPES = frozenset({"function", "custom"})  # what a namespace may hold


class Tools:
    """The request's function tools as the chat template sees them (namespaces
    flattened, hosted tools left out) and the way back from a called name to
    (namespace, name).

    A namespaced function is shown to the model under its own name when no other tool
    has that name, as `namespace + name` when the two read as one name (Codex's
    `mcp__server__` + `tool`), else as `namespace.name`; the model may call any of these."""

    def __init__(self) -> None:
        self.chat: List[dict] = []
        self.shown: Dict[Tuple[Optional[str], str], str] = {}  # (namespace, name) -> the name the model sees
        self.calls: Dict[str, Tuple[Optional[str], str]] = {}  # a name the model calls -> (namespace, name)
        # The shown names of functions marked `strict: true` -> where their parameters are
        # (call_hold.check_strict); the template does not see the mark.
        self.strict: Dict[str, str] = {}

    def resolve(self, called: str) -> Tuple[Optional[str], str]:
        return self.calls.get(called, (None, called))

    def shown_name(self, namespace: Optional[str], name: str) -> str:
        return self.shown.get((namespace, name)) or _joined(namespace, name)


def _joined(namespace: Optional[str], name: str) -> str:
    if not namespace:
        return name
    return namespace + name if namespace.endswith("_") or name.startswith("_") else f"{namespace}.{name}"


def _function(t: dict, where: str, namespace: Optional[str], ns_description: Optional[str]) -> tuple:
    """-> (namespace, name, description, parameters, where the parameters are if the
    function is `strict: true`, else None)."""
    name = string_field(t, "name", where)
    if not isinstance(t.get("strict", False), (bool, type(None))):
        raise bad(f"'{where}.strict' must be a boolean", f"{where}.strict")
    params = t.get("parameters")
    check_schema(params, f"{where}.parameters", param=f"{where}.parameters")
    desc = t.get("description")
    if desc is not None and not isinstance(desc, str):
        raise bad(f"'{where}.description' must be a string", f"{where}.description")
    if ns_description:
        desc = f"{desc}\n\n({namespace}: {ns_description})" if desc else f"({namespace}: {ns_description})"
    strict = f"{where}.parameters" if t.get("strict") is True else None
    return namespace, name, desc, params or {"type": "object", "properties": {}}, strict


def parse_tools(raw, warnings: List[str]) -> Tools:
    """`tools` -> Tools; hosted tools are left out, with a line in `warnings`."""
    tools = Tools()
    if raw is None:
        return tools
    if not isinstance(raw, list):
        raise bad("'tools' must be an array", "tools")
    entries = []
    for i, t in enumerate(raw):
        entries += _tool_entries(t, f"tools[{i}]", warnings)
    _name_tools(tools, entries)
    return tools


def _tool_entries(t, where: str, warnings: List[str]) -> List[tuple]:
    """One `tools` entry -> its functions as `_function` gives them."""
    if not isinstance(t, dict):
        raise bad(f"'{where}' must be an object", where)
    kind = t.get("type")
    if kind == "function":
        return [_function(t, where, None, None)]
    if kind == "namespace":
        return _namespace_entries(t, where, warnings)
    if not isinstance(kind, str):
        raise bad(f"'{where}.type' must be a string such as 'function'", f"{where}.type")
    _check_known(kind, where, TOOL_TYPES)
    warnings.append(f"ignored {where} of type {json.dumps(kind)[:40]}: hosted tools do not run here")
    return []


def _check_known(kind: str, where: str, known: frozenset) -> None:
    """A tool type the API does not define is a client's mistake, not a tool to skip."""
    if kind not in known:
        raise bad(f"'{where}.type' {json.dumps(kind)[:40]} is not a tool type; expected one of "
                  f"{', '.join(sorted(known))}", f"{where}.type")


def _namespace_entries(t: dict, where: str, warnings: List[str]) -> List[tuple]:
    namespace = string_field(t, "name", where)
    children = t.get("tools")
    if not isinstance(children, list):
        raise bad(f"'{where}.tools' must be an array of function tools", f"{where}.tools")
    ns_desc = t.get("description") if isinstance(t.get("description"), str) else None
    entries = []
    for j, child in enumerate(children):
        cw = f"{where}.tools[{j}]"
        if not isinstance(child, dict) or not isinstance(child.get("type"), str):
            raise bad(f"'{cw}' must be a tool object with a 'type'", cw)
        if child["type"] == "function":
            entries.append(_function(child, cw, namespace, ns_desc))
        else:
            _check_known(child["type"], cw, _NAMESPACED_TYPES)
            warnings.append(f"ignored {cw} of type {json.dumps(child['type'])[:40]}: only function tools run")
    return entries


def _name_tools(tools: Tools, entries: List[tuple]) -> None:
    """Fill `tools` from the functions: the name each is shown under (see Tools), the
    chat template's tool list, and every spelling a call may come back with."""
    bare = Counter(entry[1] for entry in entries)
    for namespace, name, desc, params, strict in entries:
        if namespace is None or bare[name] > 1 or namespace.endswith("_") or name.startswith("_"):
            shown = _joined(namespace, name)
        else:
            shown = name
        fn = {"name": shown, "description": desc, "parameters": params}  # chat completions' key order
        if not desc:
            del fn["description"]
        tools.chat.append({"type": "function", "function": fn})
        tools.shown[(namespace, name)] = shown
        tools.calls[shown] = (namespace, name)
        if strict:
            tools.strict[shown] = strict
    for namespace, name, *_ in entries:  # other spellings a model may use for a namespaced call
        if namespace is not None:
            for alias in (_joined(namespace, name), f"{namespace}.{name}", namespace + name, name):
                if alias != name or bare[name] == 1:
                    tools.calls.setdefault(alias, (namespace, name))


def tool_choice(body: dict, tools: Tools, warnings: List[str]) -> str:
    """-> 'auto', 'none', 'required' or the shown name of the one function to call."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad(f"'tool_choice' must be 'auto', 'none', 'required' or an object, got {choice!r}",
                       "tool_choice")
        if choice == "required" and not tools.chat:
            raise bad("'tool_choice' is 'required' but 'tools' has no function tools", "tool_choice")
        return choice
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        raise bad("'tool_choice' must be a string or an object with a 'type'", "tool_choice")
    if choice["type"] == "function":
        name = string_field(choice, "name", "tool_choice")
        namespace = choice.get("namespace") if isinstance(choice.get("namespace"), str) else None
        key = (namespace, name) if namespace else tools.resolve(name)
        if key not in tools.shown:
            raise bad(f"'tool_choice' names the function {name!r}, which is not in 'tools'", "tool_choice.name")
        return tools.shown[key]
    warnings.append(f"ignored tool_choice of type {json.dumps(choice['type'])[:40]}")
    return "auto"
