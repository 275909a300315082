"""OpenAI Responses API: POST /v1/responses (what Codex CLI speaks), streaming or not.

The request becomes the same chat messages as /v1/chat/completions (chat.py's shape):
responses_input.py reads `instructions` and `input` items, responses_tools.py `tools`. The output pieces
(reasoning / content / tool calls, split as for chat completions) become output items:
`reasoning`, `message` and `function_call`.

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
from typing import Dict, List, Optional, Tuple

from starlette.requests import Request as HTTPRequest

from .answer_hold import hold_to_format
from .chat import build_prompt
from .generation import Generation, finish_error
from .reasoning import Piece
from .request_path import Reply, check_model, handle, new_generation, sse_event
from .responses_input import check_accepted, input_messages, thinking_flag
from .responses_tools import Tools, parse_tools, tool_choice
from .validation import field, parse_json_body, sampling_params

WARNING_HEADER = "x-mlxmtp-warning"
WARNING_HEADER_CHARS = 2000  # HTTP clients refuse long header lines (Node: 16 KiB for all headers)


def warning_header(warnings: List[str]) -> Dict[str, str]:
    """The warnings as one header, the first ones only when they would make it long."""
    shown: List[str] = []
    for i, w in enumerate(warnings):
        if sum(len(x) + 2 for x in shown) + len(w) > WARNING_HEADER_CHARS:
            shown.append(f"and {len(warnings) - i} more")
            break
        shown.append(w)
    return {WARNING_HEADER: "; ".join(shown)} if shown else {}


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


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
        return sse_event(kind, {"type": kind, "sequence_number": next(self.seq), **data})

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


class ResponsesReply(Reply):
    """The response object, or its stream of events (see the module docstring)."""

    def __init__(self, tok, tools: Tools, shape: ResponseShape, stream: bool, warnings: List[str]):
        self.tok = tok
        self.tools = tools
        self.shape = shape
        self.stream = stream
        self.headers = warning_header(warnings)
        self.items = OutputItems(tools)  # the stream's

    def response(self, gen: Generation) -> dict:
        items = OutputItems(self.tools)
        items.feed(gen.pieces)
        status = _final_status(gen)
        items.close(status)
        return self.shape.build(status, items.output, usage(gen, self.tok))

    def opening(self, gen: Generation) -> List[str]:
        return [self.items.event("response.created", response=self.shape.build("in_progress", [])),
                self.items.event("response.in_progress", response=self.shape.build("in_progress", []))]

    def update(self, gen: Generation, pieces: List[Piece], ev) -> List[str]:
        return self.items.feed(pieces)

    def finish(self, gen: Generation) -> List[str]:
        items = self.items
        if gen.error:
            done = [item for item in items.output if item.get("status") == "completed"]
            err = finish_error(gen)
            return [items.event("error", code="server_error" if err.status >= 500 else "invalid_request_error",
                                message=err.message, param=err.param),
                    items.event("response.failed", response=self.shape.build("failed", done, usage(gen, self.tok),
                                                                             error=gen.error))]
        status = _final_status(gen)
        out = items.close(status)
        out.append(items.event(f"response.{status}", response=self.shape.build(status, items.output,
                                                                              usage(gen, self.tok))))
        return out


# ------------------------------------------------------------------ handler
def _chat_tools(tools: Tools, choice: str) -> List[dict]:
    """The tools the template shows: none for 'none', only the forced one for a name."""
    if choice == "none":
        return []
    if choice not in ("auto", "required"):
        return [t for t in tools.chat if t["function"]["name"] == choice]
    return tools.chat


def _prepare(state, raw: bytes) -> Tuple[Generation, ResponsesReply]:
    """Validation and templating, off the event loop."""
    body = parse_json_body(raw)
    model = check_model(state, body)  # answered under the name the client used
    check_accepted(body)
    warnings: List[str] = []
    tools = parse_tools(body.get("tools"), warnings)
    choice = tool_choice(body, tools, warnings)
    chat_tools = _chat_tools(tools, choice) or None
    messages = input_messages(body, tools)
    thinking = thinking_flag(state, body)
    max_out = field(body, "max_output_tokens", int, minimum=1)
    stream = field(body, "stream", bool, default=False)
    params = sampling_params(body, state.vocab_size, defaults=state.sampling_defaults)
    prompt = build_prompt(state.tok, messages, chat_tools, thinking, state.template_kwargs(), tool_choice=choice,
                          param="input")
    gen = new_generation(state, body, prompt.ids, max_out, params, prompt.splitter(chat_tools), param="input",
                         shared_prefix=prompt.shared)
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    hold_to_format(gen.req, state.tok, text.get("format"), "text.format", prompt, chat_tools, tools.strict,
                   state.constrain_tool_calls)
    if chat_tools and body.get("parallel_tool_calls") is False:
        gen.one_tool_call()
    shape = ResponseShape(body, model, params, max_out)
    return gen, ResponsesReply(state.tok, tools, shape, stream, warnings)


async def responses(request: HTTPRequest):
    return await handle(request, _prepare)
