"""Anthropic-compatible endpoint: POST /v1/messages (what Claude Code speaks).

Taken as clients send it: `role: "system"` entries inside `messages` (placed by
chat.place_system), `output_config.format` (a JSON schema the answer is held to:
structured_output.py), beta fields (`context_management`, the rest of `output_config`, `metadata`,
`?beta=true`) ignored, `thinking.budget_tokens` an upper bound on the reasoning
(thinking_budget.py), `tool_choice` any / tool forcing the call (chat.build_prompt), tools
marked `defer_loading` listed only where a tool_reference loads them (anthropic_input.py).
A last assistant message with text is a prefill: the answer continues it (chat.render).
`count_tokens` renders through the same path, so it is the prompt the request prefills.
"""

from __future__ import annotations

import json
import uuid
from typing import List, Optional, Tuple

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from .answer_hold import hold_to_format
from .anthropic_input import anthropic_messages, anthropic_tools, continues_prefill, listed_tools
from .chat import Prompt, build_prompt
from .errors import APIError, anthropic_error_body
from .generation import Generation, finish_error
from .request_path import Reply, check_model, handle, new_generation, sse_event
from .thinking_budget import add_budget
from .validation import anthropic_tool_choice, field, parse_json_body, sampling_params, string_list


def _stop_reason(gen: Generation) -> str:
    if gen.finish_reason == "length":
        return "max_tokens"
    if gen.tool_calls():
        return "tool_use"
    if gen.stop_sequence() is not None:
        return "stop_sequence"
    return "end_turn"


def _input_usage(gen: Generation) -> dict:
    """Anthropic's split of the prompt: `input_tokens` are those prefilled, the ones restored
    from the prefix cache are `cache_read_input_tokens` (their sum is the prompt, which is
    what count_tokens returns); nothing is billed as written to a cache."""
    cached = gen.stats.cached_prompt_tokens if gen.stats else 0
    return {"input_tokens": gen.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached}


def _usage(gen: Generation) -> dict:
    return {**_input_usage(gen), "output_tokens": gen.completion_tokens, "mtp": gen.mtp_usage()}


def _tool_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


# ------------------------------------------------------------------ request
def _thinking(body: dict) -> Tuple[Optional[bool], Optional[int]]:
    """-> (enable_thinking for the template, None: the server's default; the reasoning budget
    or None). 'adaptive' (Claude Code's main turns) leaves thinking to the model: the
    template's default, or the server's `--chat-template-args`."""
    thinking = field(body, "thinking", dict)
    if thinking is None:
        return None, None
    kind = thinking.get("type")
    if kind == "enabled":
        return True, field(thinking, "budget_tokens", int, minimum=1, label="thinking.budget_tokens")
    if kind == "adaptive":
        return None, None
    if kind == "disabled":
        return False, None
    raise APIError(400, "thinking.type: must be 'enabled', 'adaptive' or 'disabled'")


def _conversation(state, body: dict) -> Tuple[str, Prompt, Optional[List[dict]]]:
    """-> (the model name asked for, the prompt, the tools the model sees). Shared by
    messages and count_tokens."""
    model = check_model(state, body, anthropic=True)
    if "messages" not in body:
        raise APIError(400, "messages: field required")
    tools = anthropic_tools(body.get("tools"))
    msgs = anthropic_messages(body.get("system"), body["messages"], tools)
    choice = anthropic_tool_choice(body, tools)
    if choice == "none":
        tools = None
    prefill = continues_prefill(msgs, f"messages.{len(body['messages']) - 1}.content")
    prompt = build_prompt(state.tok, msgs, listed_tools(body.get("tools"), tools, choice), _thinking(body)[0],
                          state.template_kwargs(), tool_choice=choice, continue_final=prefill)
    return model, prompt, tools


def _prepare(state, raw: bytes) -> Tuple[Generation, "MessageReply"]:
    """Unknown fields (beta features such as context_management, output_config) are ignored."""
    body = parse_json_body(raw)
    max_tokens = field(body, "max_tokens", int, required=True, minimum=1)
    model, prompt, tools = _conversation(state, body)
    stop = string_list(body, "stop_sequences")
    field(body, "metadata", dict)  # read by no one here, but a client's mistake all the same
    stream = field(body, "stream", bool, default=False)
    params = sampling_params(body, state.vocab_size, anthropic=True, defaults=state.sampling_defaults)
    gen = new_generation(state, body, prompt.ids, max_tokens, params, prompt.splitter(tools), stop=stop,
                         anthropic=True, shared_prefix=prompt.shared)
    if not prompt.opening:  # a forced tool call has no reasoning to bound
        add_budget(gen.req, state.tok, _thinking(body)[1], prompt.in_think)
    fmt, where = _output_format(body)
    if fmt is not None and prompt.continues:
        raise APIError(400, f"{where}: a prefilled answer cannot also be held to a format")
    strict = {t["name"]: f"tools.{i}.input_schema" for i, t in enumerate(body.get("tools") or [])
              if t.get("strict") is True and "input_schema" in t}  # Anthropic's strict tool use
    hold_to_format(gen.req, state.tok, fmt, where, prompt, tools, strict, state.constrain_tool_calls)
    choice = body.get("tool_choice")
    if tools and isinstance(choice, dict) and field(choice, "disable_parallel_tool_use", bool,
                                                    label="tool_choice.disable_parallel_tool_use"):
        gen.one_tool_call()
    return gen, MessageReply(model, stream)


def _output_format(body: dict) -> Tuple[Optional[dict], str]:
    """Structured outputs: `output_config.format`, or the beta's `output_format`."""
    config = field(body, "output_config", dict)
    if config is not None and config.get("format") is not None:
        return config["format"], "output_config.format"
    return body.get("output_format"), "output_format"


async def messages(request: HTTPRequest):
    return await handle(request, _prepare)


def _count(state, raw: bytes) -> int:
    return len(_conversation(state, parse_json_body(raw))[1].ids)


async def count_tokens(request: HTTPRequest):
    """POST /v1/messages/count_tokens (Claude Code calls it): the rendered prompt's length."""
    state = request.app.state.server
    return JSONResponse({"input_tokens": await state.prepare(_count, await request.body())})


# ------------------------------------------------------------------ output
def _merge_blocks(blocks: List[dict]) -> List[dict]:
    out: List[dict] = []
    for b in blocks:
        if out and b["type"] == out[-1]["type"] == "text":
            out[-1]["text"] += b["text"]
        elif out and b["type"] == out[-1]["type"] == "thinking":
            out[-1]["thinking"] += b["thinking"]
        else:
            out.append(b)
    return out


def _content_block(kind: str, value) -> dict:
    if kind == "reasoning":
        return {"type": "thinking", "thinking": value, "signature": ""}
    if kind == "content":
        return {"type": "text", "text": value}
    return {"type": "tool_use", "id": _tool_id(), "name": value["name"], "input": value["arguments"]}


class MessageReply(Reply):
    """The message object, or its stream: a content block per run of text, of thinking,
    and per tool call."""

    def __init__(self, model: str, stream: bool):
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = model  # answered under the name the client used
        self.stream = stream
        self.index = -1  # the current content block
        self.open_kind: Optional[str] = None  # the kind of piece the open block holds

    def response(self, gen: Generation) -> dict:
        content = [_content_block(kind, value) for kind, value in gen.pieces]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": _merge_blocks(content), "stop_reason": _stop_reason(gen),
                "stop_sequence": gen.stop_sequence(), "usage": _usage(gen)}

    def opening(self, gen: Generation) -> List[str]:
        return [sse_event("message_start", {"type": "message_start", "message": {
                    "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    # The prefix cache is looked up after this: message_delta gives the split.
                    "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": 0}}}),
                self.keepalive()]

    def keepalive(self) -> str:
        return sse_event("ping", {"type": "ping"})

    def update(self, gen: Generation, pieces, ev) -> List[str]:
        out: List[str] = []
        for kind, value in pieces:
            out += self._tool_use(value) if kind == "tool_call" else self._text(kind, value)
        return out

    def finish(self, gen: Generation) -> List[str]:
        out = self._close()
        if gen.error:
            return out + [sse_event("error", anthropic_error_body(finish_error(gen)))]
        return out + [
            sse_event("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": _stop_reason(gen),
                                                  "stop_sequence": gen.stop_sequence()},
                                        "usage": _usage(gen)}),
            sse_event("message_stop", {"type": "message_stop"})]

    def _close(self) -> List[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict) -> List[str]:
        out = self._close()
        self.index += 1
        return out + [sse_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                        "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _tool_use(self, call: dict) -> List[str]:
        out = self._start({"type": "tool_use", "id": _tool_id(), "name": call["name"], "input": {}})
        out.append(self._delta({"type": "input_json_delta",
                                "partial_json": json.dumps(call["arguments"], ensure_ascii=False)}))
        out.append(sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        return out

    def _text(self, kind: str, value: str) -> List[str]:
        out: List[str] = []
        if kind != self.open_kind:
            block = {"type": "text", "text": ""} if kind == "content" else \
                {"type": "thinking", "thinking": "", "signature": ""}
            out = self._start(block)
            self.open_kind = kind
        delta = {"type": "text_delta", "text": value} if kind == "content" else \
            {"type": "thinking_delta", "thinking": value}
        out.append(self._delta(delta))
        return out
