"""Request validation at the edge, for both APIs: nothing the engine cannot run gets past.

Every check raises `APIError(400, ...)` naming the field, so a bad request is answered
in its API's own error shape before it reaches the engine thread, where a failure would
cost every request in flight. A sampling field's range is the engine's (sampling/params.py,
RANGES), narrowed to each API's documented one (OpenAI: temperature 0-2, penalties -2..2,
logit_bias values -100..100; Anthropic: temperature 0-1); token ids must lie in the
vocabulary, the draft depth in [0, MAX_DRAFT_DEPTH], and every string must be encodable
(JSON allows lone surrogates, which no tokenizer takes).

Plain functions rather than pydantic models: the two APIs differ in names, ranges and
defaults, and these few checks keep every message pointing at its field.
"""

from __future__ import annotations

import json
import math
from typing import Any, List, Optional

from ..engine.limits import MAX_DRAFT_DEPTH, MAX_TOP_LOGPROBS
from ..engine.sampling.params import RANGES, SamplingParams
from . import json_depth
from .errors import APIError

_MISSING = object()


def parse_json_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"")
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(400, f"invalid JSON body: {e}") from e
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_values(body)
    return body


def check_values(value: Any, path: str = "") -> None:
    """Every string (keys included) must be valid Unicode: JSON's "\\ud800" is not. Every
    number must be finite: Python's json reads JavaScript's NaN and Infinity, which no
    JSON reply can hold (the Responses API echoes fields such as `text.format` back). No
    value may nest deeper than json_depth.MAX_DEPTH (echoed back, it could not be written)."""
    stack = [(value, path, 0)]
    while stack:
        v, p, level = stack.pop()  # level: the arrays and objects `v` is inside
        if isinstance(v, (dict, list)) and level >= json_depth.MAX_DEPTH:  # as json_depth.depth counts
            top = p.split(".")[0].split("[")[0]
            raise APIError(400, f"'{top}' is nested deeper than {json_depth.MAX_DEPTH} levels (at {p[:120]}...)",
                           param=top)
        if isinstance(v, str):
            _encodable(v, p)
        elif isinstance(v, float) and not math.isfinite(v):
            name = p or "body"
            raise APIError(400, f"'{name}' must be a finite number, got {v} (NaN and Infinity are not JSON; "
                                "numbers beyond 1.8e308 are read as Infinity)", param=name)
        elif isinstance(v, dict):
            for key, item in v.items():
                _encodable(key, p)
                stack.append((item, f"{p}.{key}" if p else key, level + 1))
        elif isinstance(v, list):
            stack.extend((item, f"{p}[{i}]", level + 1) for i, item in enumerate(v))


def _encodable(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        name = path or "body"
        raise APIError(400, f"'{name}' contains invalid Unicode (a lone surrogate at character {e.start})",
                       param=name) from e


def _type_name(types) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(names.get(t, t.__name__) for t in types)


def field(body: dict, name: str, types, *, required: bool = False, default: Any = None,
          minimum: Optional[float] = None, maximum: Optional[float] = None,
          exclusive_minimum: bool = False, label: Optional[str] = None) -> Any:
    """Fetch `name` from `body`, checking type, finiteness and range; None counts as absent.

    `label` is the name used in messages (e.g. "stream_options.include_usage")."""
    label = label or name
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        if required:
            raise APIError(400, f"'{label}' is a required field", param=label)
        return default
    types = types if isinstance(types, tuple) else (types,)
    # bool is an int in Python; JSON true is not a number. Ints are fine where floats are.
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok and float in types and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise APIError(400, f"'{label}' must be of type {_type_name(types)}, got {json.dumps(value)[:80]}",
                       param=label)
    if isinstance(value, float) and not math.isfinite(value):
        raise APIError(400, f"'{label}' must be a finite number, got {value}", param=label)
    if minimum is not None and (value < minimum or (exclusive_minimum and value == minimum)):
        cmp = ">" if exclusive_minimum else ">="
        raise APIError(400, f"'{label}' must be {cmp} {minimum}, got {value}", param=label)
    if maximum is not None and value > maximum:
        raise APIError(400, f"'{label}' must be <= {maximum}, got {value}", param=label)
    return value


def string_list(body: dict, name: str) -> list:
    """A stop field: a string or a list of strings."""
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise APIError(400, f"'{name}' must be a string or an array of strings", param=name)


def token_ids(value: list, vocab_size: int, name: str) -> List[int]:
    """A list of token ids, each in [0, vocab_size)."""
    for i, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise APIError(400, f"'{name}[{i}]' must be a token id in [0, {vocab_size}), got {json.dumps(t)[:40]}",
                           param=name)
    return list(value)


def _logit_bias(body: dict, vocab_size: int) -> Optional[dict]:
    raw = field(body, "logit_bias", dict)
    if not raw:
        return None
    bias = {}
    for key in raw:
        try:
            tok = int(key)
        except ValueError as e:
            raise APIError(400, f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias") from e
        if not 0 <= tok < vocab_size:
            raise APIError(400, f"'logit_bias' key {key} is not a token id in [0, {vocab_size})", param="logit_bias")
        if raw[key] is None:  # `field` reads null as absent; here it would reach the sampler
            raise APIError(400, f"'logit_bias.{key}' must be a number, got null", param=f"logit_bias.{key}")
        bias[tok] = field(raw, key, float, minimum=-100.0, maximum=100.0, label=f"logit_bias.{key}")
    return bias


def sampling_params(body: dict, vocab_size: int, *, anthropic: bool = False,
                    defaults: Optional[dict] = None) -> SamplingParams:
    """Sampling fields common to the APIs (extras like top_k/min_p as vLLM accepts them). A
    field the request leaves unset takes the server's default (`defaults`: serve's --temp
    etc., else the model's generation_config), else greedy decoding's."""
    d = defaults or {}
    temperature = _sampling_field(body, "temperature", float, d.get("temperature", 0.0),
                                 maximum=1.0 if anthropic else 2.0)
    top_p = _sampling_field(body, "top_p", float, d.get("top_p", 1.0))
    # The OpenAI-style APIs also take vLLM's top_k -1 (off).
    top_k = _sampling_field(body, "top_k", int, min(d.get("top_k", 0), vocab_size - 1), maximum=vocab_size - 1,
                            **({} if anthropic else {"minimum": -1}))
    min_p = _sampling_field(body, "min_p", float, d.get("min_p", 0.0))
    seed = _sampling_field(body, "seed", int)
    rep = _sampling_field(body, "repetition_penalty", float, d.get("repetition_penalty"), maximum=100.0)
    pres = freq = bias = None
    if not anthropic:
        pres = field(body, "presence_penalty", float, minimum=-2.0, maximum=2.0)
        freq = field(body, "frequency_penalty", float, minimum=-2.0, maximum=2.0)
        bias = _logit_bias(body, vocab_size)
    return SamplingParams(
        temperature=float(temperature), top_p=float(top_p), top_k=max(0, top_k), min_p=float(min_p),
        repetition_penalty=rep, presence_penalty=pres or None, frequency_penalty=freq or None,
        logit_bias=bias, seed=seed, reproducible=seed is not None,  # same seed, same text (engine/sampling/seeded.py)
    )


def _sampling_field(body: dict, name: str, types, default: Any = None, **api) -> Any:
    """`field` in the engine's range of `name` (sampling/params.py, RANGES); `api`: the
    bounds an API narrows it to (`minimum`, `maximum`)."""
    rule = RANGES[name]
    high = rule.high - 1 if rule.high_open else rule.high  # an open end bounds integers alone (seed)
    bounds = {"minimum": rule.low, "exclusive_minimum": rule.low_open, "maximum": high, **api}
    return field(body, name, types, default=default, **bounds)


def top_logprobs(body: dict) -> Optional[int]:
    """`top_logprobs` (chat completions and Responses): 0..MAX_TOP_LOGPROBS, OpenAI's range."""
    return field(body, "top_logprobs", int, minimum=0, maximum=MAX_TOP_LOGPROBS)


def num_draft(body: dict) -> Optional[int]:
    """Non-standard `num_draft`: pin this request's MTP depth (0 = no drafting)."""
    return field(body, "num_draft", int, minimum=0, maximum=MAX_DRAFT_DEPTH)


def openai_tool_choice(body: dict, tools: Optional[List[dict]]) -> Optional[str]:
    """'none' | 'auto' | 'required' | {'type': 'function', 'function': {'name': N}} -> None, 'auto',
    'required' or the tool's name; a choice that needs tools or names a missing one is a 400."""
    choice = body.get("tool_choice")
    if choice is None:
        return None
    names = [t["function"]["name"] for t in tools or []]
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(400, f"'tool_choice' must be 'none', 'auto', 'required' or an object, got {choice!r}",
                           param="tool_choice")
        if choice == "required" and not names:
            raise APIError(400, "'tool_choice' is 'required' but no 'tools' were given", param="tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, "'tool_choice' must be {'type': 'function', 'function': {'name': ...}}",
                       param="tool_choice")
    if fn["name"] not in names:
        raise APIError(400, f"'tool_choice' names the tool {fn['name']!r}, which is not in 'tools'",
                       param="tool_choice")
    return fn["name"]


def anthropic_tool_choice(body: dict, tools: Optional[List[dict]]) -> Optional[str]:
    """{'type': 'auto' | 'any' | 'none' | 'tool', 'name': N} -> None, 'auto', 'none', 'required' or N."""
    choice = field(body, "tool_choice", dict)
    if choice is None:
        return None
    kind = choice.get("type")
    names = [t["function"]["name"] for t in tools or []]
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        if not names:
            raise APIError(400, "tool_choice: type 'any' needs 'tools'")
        return "required"
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or name not in names:
            raise APIError(400, f"tool_choice.name: {name!r} is not one of the request's tools")
        return name
    raise APIError(400, f"tool_choice.type: must be 'auto', 'any', 'tool' or 'none', got {kind!r}")
