"""OpenAI Responses API: POST /v1/responses (what Codex CLI speaks), streaming or not.

The request becomes the same chat messages as /v1/chat/completions (chat.py's shape):
`instructions` and system/developer messages system messages (chat.place_system merges
the leading ones and places a later one where the template takes it), `message` items turns, `function_call` items an assistant turn's `tool_calls`, `function_call_output`
items `tool` messages, and a `reasoning` item the next assistant turn's
`reasoning_content`. The output pieces (reasoning / content / tool calls, split as for
chat completions) become output items: `reasoning`, `message` and `function_call`.

Stateless: nothing is stored (`store` is accepted either way), so `previous_response_id`
and `conversation` are refused with a 400 that says to send the whole conversation.

Tools: `function` tools are flat (`name`, `parameters` at the top level); a `namespace`
tool's functions are flattened for the chat template and a call to one comes back with
its `namespace` (what Codex and the SDK route on). Hosted tools (web_search, file_search,
code_interpreter, ...) cannot run here: they are left out and named in an
`x-mlxmtp-warning` response header.

Streaming sends `event: NAME` / `data: JSON` pairs, each with a `sequence_number`:
response.created, response.in_progress, then per output item
response.output_item.added, its content events (message: response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done;
reasoning: the same with response.reasoning_text.delta / .done; function call:
response.function_call_arguments.delta, .done), response.output_item.done; and last
response.completed, or response.incomplete when max_output_tokens cut the output. A
generation error ends the stream with an `error` event and response.failed.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections import Counter
from typing import AsyncIterator, Dict, List, Optional, Tuple

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse

from ..engine.request import Request
from .anthropic_api import _event
from .chat import _arguments, build_prompt
from .errors import APIError
from .generation import Generation, finish_error, output_budget
from .openai_api import KEEPALIVE, SSE_HEADERS, _collect, _guarded, check_model
from .reasoning import Piece
from .validation import field, num_draft, parse_json_body, sampling_params

WARNING_HEADER = "x-mlxmtp-warning"
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_SUMMARIES = ("auto", "concise", "detailed", "none")
_TEXT_PARTS = ("input_text", "output_text", "text")
_STATELESS = ("this server keeps no conversation state (nothing is stored): send the whole conversation "
              "in 'input' instead of '{}'")


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _string(obj: dict, key: str, where: str, *, required: bool = True) -> Optional[str]:
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value):
        raise _bad(f"'{where}.{key}' must be a non-empty string", f"{where}.{key}")
    return value


# ------------------------------------------------------------------ tools
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

    def resolve(self, called: str) -> Tuple[Optional[str], str]:
        return self.calls.get(called, (None, called))

    def shown_name(self, namespace: Optional[str], name: str) -> str:
        return self.shown.get((namespace, name)) or _joined(namespace, name)


def _joined(namespace: Optional[str], name: str) -> str:
    if not namespace:
        return name
    return namespace + name if namespace.endswith("_") or name.startswith("_") else f"{namespace}.{name}"


def _function(t: dict, where: str, namespace: Optional[str], ns_description: Optional[str]) -> tuple:
    name = _string(t, "name", where)
    params = t.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise _bad(f"'{where}.parameters' must be a JSON schema object", f"{where}.parameters")
    desc = t.get("description")
    if desc is not None and not isinstance(desc, str):
        raise _bad(f"'{where}.description' must be a string", f"{where}.description")
    if ns_description:
        desc = f"{desc}\n\n({namespace}: {ns_description})" if desc else f"({namespace}: {ns_description})"
    return namespace, name, desc, params or {"type": "object", "properties": {}}


def parse_tools(raw, warnings: List[str]) -> Tools:
    tools = Tools()
    if raw is None:
        return tools
    if not isinstance(raw, list):
        raise _bad("'tools' must be an array", "tools")
    entries = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise _bad(f"'{where}' must be an object", where)
        kind = t.get("type")
        if kind == "function":
            entries.append(_function(t, where, None, None))
        elif kind == "namespace":
            namespace = _string(t, "name", where)
            children = t.get("tools")
            if not isinstance(children, list):
                raise _bad(f"'{where}.tools' must be an array of function tools", f"{where}.tools")
            ns_desc = t.get("description") if isinstance(t.get("description"), str) else None
            for j, child in enumerate(children):
                cw = f"{where}.tools[{j}]"
                if not isinstance(child, dict) or not isinstance(child.get("type"), str):
                    raise _bad(f"'{cw}' must be a tool object with a 'type'", cw)
                if child["type"] == "function":
                    entries.append(_function(child, cw, namespace, ns_desc))
                else:
                    warnings.append(f"ignored {cw} of type {json.dumps(child['type'])[:40]}: only function tools run")
        elif isinstance(kind, str):
            warnings.append(f"ignored {where} of type {json.dumps(kind)[:40]}: hosted tools do not run here")
        else:
            raise _bad(f"'{where}.type' must be a string such as 'function'", f"{where}.type")
    bare = Counter(name for _, name, _, _ in entries)
    for namespace, name, desc, params in entries:
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
    for namespace, name, _, _ in entries:  # other spellings a model may use for a namespaced call
        if namespace is not None:
            for alias in (_joined(namespace, name), f"{namespace}.{name}", namespace + name, name):
                if alias != name or bare[name] == 1:
                    tools.calls.setdefault(alias, (namespace, name))
    return tools


def tool_choice(body: dict, tools: Tools, warnings: List[str]) -> str:
    """-> 'auto', 'none', 'required' or the shown name of the one function to call."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _bad(f"'tool_choice' must be 'auto', 'none', 'required' or an object, got {choice!r}",
                       "tool_choice")
        if choice == "required" and not tools.chat:
            raise _bad("'tool_choice' is 'required' but 'tools' has no function tools", "tool_choice")
        return choice
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        raise _bad("'tool_choice' must be a string or an object with a 'type'", "tool_choice")
    if choice["type"] == "function":
        name = _string(choice, "name", "tool_choice")
        namespace = choice.get("namespace") if isinstance(choice.get("namespace"), str) else None
        key = (namespace, name) if namespace else tools.resolve(name)
        if key not in tools.shown:
            raise _bad(f"'tool_choice' names the function {name!r}, which is not in 'tools'", "tool_choice.name")
        return tools.shown[key]
    warnings.append(f"ignored tool_choice of type {json.dumps(choice['type'])[:40]}")
    return "auto"


# ------------------------------------------------------------------ input -> chat messages
def _text(content, where: str, *, tool_output: bool = False) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"'{where}' must be a string or an array of content parts", where)
    texts = []
    for j, part in enumerate(content):
        pw = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise _bad(f"'{pw}' must be a content part object", pw)
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise _bad(f"'{pw}.text' must be a string", f"{pw}.text")
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif tool_output and isinstance(kind, str):
            texts.append(f"[{kind} omitted: this server reads text only]")
        else:
            raise _bad(f"'{pw}.type' {kind!r} is not supported (text parts only: input_text, output_text)",
                       f"{pw}.type")
    return "".join(texts)


def _reasoning_text(item: dict, where: str) -> str:
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise _bad(f"'{where}.{key}' must be an array", f"{where}.{key}")
        texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if texts:
            return "\n".join(texts)
    return ""


def input_messages(body: dict, tools: Tools) -> List[dict]:
    """`instructions` + `input` -> chat messages. System and developer messages stay system
    messages where they are: render (chat.place_system) merges the leading ones into the
    system prompt and places a later one as the template allows."""
    messages: List[dict] = []
    instructions = field(body, "instructions", str)
    if instructions:
        messages.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if raw is None:
        raise _bad("'input' is a required field", "input")
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise _bad("'input' must be a string or a non-empty array of input items", "input")
    reasoning: List[str] = []  # waiting for the assistant turn it belongs to

    def assistant(content: str) -> dict:
        msg = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        messages.append(msg)
        return msg

    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"'{where}' must be an input item object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"'{where}.role' must be 'user', 'assistant', 'system' or 'developer', got {role!r}",
                           f"{where}.role")
            if "content" not in item:
                raise _bad(f"'{where}.content' is a required field", f"{where}.content")
            text = _text(item["content"], f"{where}.content")
            if role in ("system", "developer"):
                messages.append({"role": "system", "content": text})
            elif role == "assistant":
                assistant(text)
            else:
                messages.append({"role": "user", "content": text})
        elif kind == "function_call":
            call_id = _string(item, "call_id", where)
            name = _string(item, "name", where)
            args = item.get("arguments")
            if not isinstance(args, str):
                raise _bad(f"'{where}.arguments' must be a JSON string", f"{where}.arguments")
            namespace = _string(item, "namespace", where, required=False)
            call = {"id": call_id, "type": "function",
                    "function": {"name": tools.shown_name(namespace, name), "arguments": _arguments(args)}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or reasoning:
                last = assistant("")
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if "output" not in item:
                raise _bad(f"'{where}.output' is a required field", f"{where}.output")
            output = _text(item["output"], f"{where}.output", tool_output=True)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if text:
                reasoning.append(text)
        else:
            raise _bad(f"'{where}.type' {kind!r} is not supported (message, function_call, function_call_output, "
                       "reasoning)", f"{where}.type")
    if not any(m["role"] != "system" for m in messages):
        raise _bad("'input' has no user, assistant or tool turn", "input")
    return messages


def thinking_flag(state, body: dict) -> Optional[bool]:
    """reasoning.effort 'none' / 'minimal' -> thinking off, other efforts on, where the
    chat template has enable_thinking; otherwise the template's default."""
    reasoning = field(body, "reasoning", dict)
    if reasoning is None:
        return None
    effort = field(reasoning, "effort", str, label="reasoning.effort")
    if effort is not None and effort not in _EFFORTS:
        raise _bad(f"'reasoning.effort' must be one of {', '.join(_EFFORTS)}, got {effort!r}", "reasoning.effort")
    summary = field(reasoning, "summary", str, label="reasoning.summary")
    if summary is not None and summary not in _SUMMARIES:
        raise _bad(f"'reasoning.summary' must be one of {', '.join(_SUMMARIES)}, got {summary!r}",
                   "reasoning.summary")
    if effort is None or "enable_thinking" not in str(getattr(state.tok, "chat_template", None) or ""):
        return None
    return effort not in ("none", "minimal")


# ------------------------------------------------------------------ output
def _reasoning_item(item_id: str, text: Optional[str], status: str) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: Optional[str], status: str) -> dict:
    content = [] if text is None else [_output_text(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


class OutputItems:
    """Pieces -> output items, and the stream events that build them. The same code
    serves both paths: the non-streaming one just drops the events."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.output: List[dict] = []
        self.seq = itertools.count()
        self.open: Optional[dict] = None  # {"kind", "id", "index", "text"}

    def event(self, kind: str, /, **data) -> str:
        return _event(kind, {"type": kind, "sequence_number": next(self.seq), **data})

    def feed(self, pieces: List[Piece]) -> List[str]:
        out: List[str] = []
        for kind, value in pieces:
            if kind == "tool_call":
                out += self.close("completed")
                out += self._call(value)
                continue
            if self.open is None or self.open["kind"] != kind:
                out += self.close("completed")
                out += self._start(kind)
            self.open["text"] += value
            ids = {"item_id": self.open["id"], "output_index": self.open["index"], "content_index": 0}
            if kind == "content":
                out.append(self.event("response.output_text.delta", **ids, delta=value, logprobs=[]))
            else:
                out.append(self.event("response.reasoning_text.delta", **ids, delta=value))
        return out

    def _start(self, kind: str) -> List[str]:
        index = len(self.output)
        if kind == "content":
            item_id = _new_id("msg_")
            item, part = _message_item(item_id, None, "in_progress"), _output_text("")
        else:
            item_id = _new_id("rs_")
            item, part = _reasoning_item(item_id, None, "in_progress"), {"type": "reasoning_text", "text": ""}
        self.open = {"kind": kind, "id": item_id, "index": index, "text": ""}
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                           part=part)]

    def close(self, status: str) -> List[str]:
        if self.open is None:
            return []
        kind, item_id, index, text = self.open["kind"], self.open["id"], self.open["index"], self.open["text"]
        self.open = None
        ids = {"item_id": item_id, "output_index": index, "content_index": 0}
        if kind == "content":
            item, part = _message_item(item_id, text, status), _output_text(text)
            done = self.event("response.output_text.done", **ids, text=text, logprobs=[])
        else:
            item, part = _reasoning_item(item_id, text, status), {"type": "reasoning_text", "text": text}
            done = self.event("response.reasoning_text.done", **ids, text=text)
        self.output[index] = item
        return [done, self.event("response.content_part.done", **ids, part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _call(self, call: dict) -> List[str]:
        index = len(self.output)
        namespace, name = self.tools.resolve(call["name"])
        args = json.dumps(call["arguments"], ensure_ascii=False)
        item = {"id": _new_id("fc_"), "type": "function_call", "call_id": _new_id("call_"), "name": name,
                "arguments": "", "status": "in_progress"}
        if namespace:
            item["namespace"] = namespace
        added = self.event("response.output_item.added", output_index=index, item=dict(item))
        item.update(arguments=args, status="completed")
        self.output.append(item)
        ids = {"item_id": item["id"], "output_index": index}
        return [added, self.event("response.function_call_arguments.delta", **ids, delta=args),
                self.event("response.function_call_arguments.done", **ids, name=name, arguments=args),
                self.event("response.output_item.done", output_index=index, item=item)]


class ResponseShape:
    """The `response` object: fields echoed from the request, status, output, usage."""

    def __init__(self, body: dict, model: str, params, max_tokens: Optional[int]):
        self.id = _new_id("resp_")
        self.created = int(time.time())
        reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
        self.echo = {
            "instructions": body.get("instructions"), "max_output_tokens": max_tokens, "model": model,
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "previous_response_id": None,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": False, "temperature": params.temperature, "top_p": params.top_p,
            "text": body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "truncation": body.get("truncation") or "disabled", "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }

    def build(self, status: str, output: List[dict], usage: Optional[dict] = None,
              error: Optional[str] = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "background": False,
                "error": {"code": "server_error", "message": error} if error else None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                **self.echo, "output": output, "usage": usage}


def usage(gen: Generation, tok) -> dict:
    reasoning = gen.reasoning()
    reasoning_tokens = len(tok.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    return {"input_tokens": gen.prompt_tokens,
            "input_tokens_details": {"cached_tokens": gen.stats.cached_prompt_tokens if gen.stats else 0},
            "output_tokens": gen.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, gen.completion_tokens)},
            "total_tokens": gen.prompt_tokens + gen.completion_tokens, "mtp": gen.mtp_usage()}


def _final_status(gen: Generation) -> str:
    return "incomplete" if gen.finish_reason == "length" else "completed"


# ------------------------------------------------------------------ handler
def _check_accepted(body: dict) -> None:
    """Fields accepted and ignored still get their type checked; state is refused."""
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise _bad(_STATELESS.format(name), name)
    if field(body, "background", bool):
        raise _bad("background responses are not supported (nothing is stored to poll)", "background")
    if body.get("prompt") is not None:
        raise _bad("stored prompt templates ('prompt') are not supported; send 'instructions' and 'input'", "prompt")
    for name, kind in (("store", bool), ("metadata", dict), ("user", str), ("parallel_tool_calls", bool),
                       ("text", dict), ("max_tool_calls", int)):
        field(body, name, kind)
    truncation = field(body, "truncation", str)
    if truncation is not None and truncation not in ("auto", "disabled"):
        raise _bad(f"'truncation' must be 'auto' or 'disabled', got {truncation!r}", "truncation")
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(s, str) for s in include)):
        raise _bad("'include' must be an array of strings", "include")


def _prepare(state, raw: bytes):
    """Body -> (Generation, body, warnings, tools): validation and templating, off the event loop."""
    body = parse_json_body(raw)
    check_model(state, body)
    _check_accepted(body)
    warnings: List[str] = []
    tools = parse_tools(body.get("tools"), warnings)
    choice = tool_choice(body, tools, warnings)
    chat_tools = tools.chat
    if choice == "none":
        chat_tools = []
    elif choice not in ("auto", "required"):
        chat_tools = [t for t in chat_tools if t["function"]["name"] == choice]
    messages = input_messages(body, tools)
    thinking = thinking_flag(state, body)
    max_out = field(body, "max_output_tokens", int, minimum=1)
    field(body, "stream", bool)
    params = sampling_params(body, state.vocab_size)
    prompt = build_prompt(state.tok, messages, chat_tools or None, thinking, tool_choice=choice)
    ids = prompt.ids
    req = Request(prompt=ids, max_tokens=output_budget(state, len(ids), max_out, param="input"), params=params,
                  num_draft=num_draft(body))
    return Generation(state, req, splitter=prompt.splitter(chat_tools or None), body=body), warnings, tools


async def responses(request: HTTPRequest):
    state = request.app.state.server
    gen, warnings, tools = await state.off_loop(_prepare, state, await request.body())
    body, params = gen.body, gen.req.params
    model = body["model"]  # answered under the name the client used
    max_out = body.get("max_output_tokens")
    stream = field(body, "stream", bool, default=False)
    gen.start()
    shape = ResponseShape(body, model, params, max_out)
    headers = {WARNING_HEADER: "; ".join(warnings)} if warnings else {}
    if stream:
        return StreamingResponse(_guarded(gen, _stream(state, gen, shape, OutputItems(tools))),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    await _collect(gen, request)
    if gen.error:
        raise finish_error(gen)
    items = OutputItems(tools)
    items.feed(gen.pieces)
    status = _final_status(gen)
    items.close(status)
    return JSONResponse(shape.build(status, items.output, usage(gen, state.tok)), headers=headers)


async def _stream(state, gen: Generation, shape: ResponseShape, items: OutputItems) -> AsyncIterator[str]:
    yield items.event("response.created", response=shape.build("in_progress", []))
    yield items.event("response.in_progress", response=shape.build("in_progress", []))
    async for pieces, ev in gen.updates(keepalive=True):
        if ev is None:
            yield KEEPALIVE
            continue
        for chunk in items.feed(pieces):
            yield chunk
        if ev.finish_reason is None:
            continue
        if gen.error:
            yield items.event("error", code="server_error", message=gen.error, param=None)
            done = [item for item in items.output if item.get("status") == "completed"]
            yield items.event("response.failed", response=shape.build("failed", done, usage(gen, state.tok),
                                                                      error=gen.error))
            return
        status = _final_status(gen)
        for chunk in items.close(status):
            yield chunk
        yield items.event(f"response.{status}", response=shape.build(status, items.output, usage(gen, state.tok)))
