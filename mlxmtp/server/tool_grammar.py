"""The grammar of a forced tool call: the rest of the call after the opening the prompt ends
with (chat.tool_call_opening), in the model's own call syntax, its arguments held to the
tool's JSON schema.

A turn forced to call a tool (`tool_choice` required or a named function; Anthropic's any /
tool) starts with the opening `<tool_call>`; a weak model may still write text after it,
which no client can run. Held to this grammar (an llguidance Lark grammar, applied as the
response formats are: structured_output.py), every token of the call is one the call's
syntax allows, so the call always parses and its arguments always match the schema, and the
turn ends with it. The two syntaxes the Qwen3 family writes (tool_parsers.py):

* Hermes JSON: `{"name": "f", "arguments": {...}}` - the arguments are the schema's JSON;
* Qwen3-Coder XML: `<function=f>` then `<parameter=p>\\nvalue\\n</parameter>` per parameter,
  in the schema's order (required ones always, others optionally); a string is raw text
  (anything but its closing tag), any other type the schema's JSON.

The same grammar holds a call the model opens itself (`lazy`: from the token after its own
`<tool_call>`; call_hold.CallProcessor), with `free` tools' arguments any object
(OpenAI's `strict: true` holds only the tools that ask for it; the call around them is
still well-formed).

Written by hand: llguidance compiles grammars but knows neither call syntax.
"""

from __future__ import annotations

import json
from typing import Collection, Dict, List, Optional, Tuple

from . import schema_limits
from .errors import APIError
from .tool_parsers import RAW_TYPES, schema_type

END = "</tool_call>"
# What the model's own call writes after the `<tool_call>` token before a tool's name (as
# chat.tool_call_opening writes it for a forced call).
AFTER_OPEN_JSON, AFTER_OPEN_XML = "\n", "\n<function="
# JSON inside a call as the Qwen3 templates write it (json.dumps's separators, no other
# whitespace: a weak model held to bounded but free whitespace spent its tokens on it);
# keywords llguidance cannot enforce are left unenforced (an agent's tool schemas are not
# the request's fault).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
# A string parameter's raw text and its closing tag: one lexeme, so that the text may hold
# anything but the tag (a lexeme of its own would swallow the tag's first characters).
_RAW_VALUE = r"/(?s:.{%s}\n<\/parameter>\n)/ & ~/(?s:.*<\/parameter>.*<\/parameter>.*)/"


# A function defined without parameters takes none (OpenAI: "omitting parameters defines a
# function with an empty parameter list"): its call's arguments are {}.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def functions(tools: List[dict]) -> List[tuple]:
    """[(name, parameters schema)] of the tools as the chat template lists them."""
    out = []
    for t in tools or []:
        f = t.get("function", t)  # OpenAI wraps in "function"; Anthropic names its schema input_schema
        params = f.get("parameters", f.get("input_schema"))
        params = params if isinstance(params, dict) else NO_PARAMETERS
        out.append((f["name"], params))
    return out


def call_grammar(tools: List[dict], forced: str, xml: bool, end_token: Optional[int], *, lazy: bool = False,
                 free: Collection[str] = ()) -> Tuple[str, List[str]]:
    """(the Lark grammar of the call's continuation after its opening, the regular
    expressions its schemas hold): `forced` is a tool's name (the opening names it) or
    "required" (any of `tools`); `end_token`: the id of the tokenizer's own `</tool_call>`
    token, which ends the call (None: the text does). `lazy` (with "required"): the
    continuation after the `<tool_call>` token alone, the model having opened the call
    itself. `free`: names of tools whose arguments are any object (any parameters in XML),
    their schemas neither read nor bounded. A held schema past schema_limits' bounds is a
    400."""
    fns = functions(tools)
    regexes = [r for i, (name, params) in enumerate(fns) if name not in free
               for r in schema_limits.check_bounds(params, f"tools[{i}]")]
    tail = f"{_q(_tail(xml))} {_q(END) if end_token is None else f'<[{end_token}]>'}"
    raw: Dict[str, str] = {}  # the raw-text terminals the XML values use: name -> definition
    if forced != "required":
        params = dict(fns).get(forced, {"type": "object"})
        rules = [f"start: {_arguments(params, xml, raw)} {tail}\n"]
    elif not fns:
        raise APIError(400, "a forced tool call needs at least one function tool", param="tool_choice")
    else:
        opening = f"{_q(AFTER_OPEN_XML if xml else AFTER_OPEN_JSON)} " if lazy else ""
        rules = [f"start: {opening}(" + " | ".join(f"call_{i}" for i in range(len(fns))) + ")\n"]
        for i, (name, params) in enumerate(fns):
            head = _q(f"{name}>\n") if xml else _q(f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments":')
            args = _free_arguments(xml, raw) if name in free else _arguments(params, xml, raw)
            rules.append(f"call_{i}: {head} {args} {tail}\n")
    return "".join(rules) + "".join(f"{name}: {definition}\n" for name, definition in raw.items()), regexes


def _arguments(params: dict, xml: bool, raw: Dict[str, str]) -> str:
    return _xml_parameters(params, raw) if xml else f'" " {_json(params)}'


def _free_arguments(xml: bool, raw: Dict[str, str]) -> str:
    """Arguments held to the call's syntax only: any JSON object; in XML any parameters,
    each value raw text."""
    if not xml:
        return f'" " {_json({"type": "object"})}'
    raw["FREE_PARAMETER"] = r"/<parameter=[^>\n]+>\n/"
    return f"(FREE_PARAMETER {_raw_text(0, None, raw)})*"


def _tail(xml: bool) -> str:
    """What closes a call before its `</tool_call>`."""
    return "</function>\n" if xml else "}\n"


def _q(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)


def _json(schema: dict) -> str:
    return "%json " + json.dumps({"x-guidance": _JSON_OPTIONS, **_closed(schema)}, ensure_ascii=False)


def _closed(schema):
    """The schema with no keys beyond those it names, where it says nothing of others (as
    OpenAI's strict mode asks): what it accepts is still valid against the schema, and a
    weak model cannot fill a call with keys no tool reads (the demo wrote "": 1000...)."""
    if not isinstance(schema, dict):
        return schema
    out = schema_limits.map_subschemas(schema, _closed)
    if "properties" in schema and not {"additionalProperties", "patternProperties"} & set(schema):
        out["additionalProperties"] = False
    return out


def _xml_parameters(params: dict, raw: Dict[str, str]) -> str:
    """The `<parameter=...>` elements of a call, in the schema's order."""
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = set(params.get("required") or [])
    parts = []
    for name, schema in props.items():
        element = f"{_q(f'<parameter={name}>' + chr(10))} {_xml_value(schema, raw)}"
        parts.append(f"({element})" + ("" if name in required else "?"))
    return " ".join(parts) or '""'


def _xml_value(schema, raw: Dict[str, str]) -> str:
    """A parameter's value and closing tag, as tool_parsers reads it back: raw text where it
    keeps text (a string, an untyped parameter; one of its words where the schema lists
    them), the schema's JSON for any other type."""
    close = _q("\n</parameter>\n")
    if schema_type(schema) not in RAW_TYPES:
        return f"{_json(schema)} {close}"
    words = schema.get("enum", [schema["const"]] if "const" in schema else None) if isinstance(schema, dict) else None
    if words and all(isinstance(w, str) and "</parameter>" not in w for w in words):
        return "(" + " | ".join(_q(w) for w in words) + f") {close}"
    bounds = schema if isinstance(schema, dict) else {}
    low, high = bounds.get("minLength", 0), bounds.get("maxLength")
    if not (isinstance(low, int) and isinstance(high, (int, type(None))) and 0 <= low <= (high or low)):
        low, high = 0, None  # bounds a client got wrong: the text is free
    return _raw_text(low, high, raw)


def _raw_text(low: int, high: Optional[int], raw: Dict[str, str]) -> str:
    """The terminal of raw text of low..high characters and its closing tag."""
    name = f"RAW_{low}_{'N' if high is None else high}"
    raw[name] = _RAW_VALUE % f"{low},{'' if high is None else high}"
    return name


def is_xml(tok) -> bool:
    """Whether the model writes calls in Qwen3-Coder XML (chat.tool_call_opening's test)."""
    return "<function=" in str(tok.chat_template)
