"""Anthropic-compatible endpoint: POST /v1/messages (what Claude Code speaks).

Taken as clients send it: `role: "system"` entries inside `messages` (placed by
chat.place_system), beta fields (`context_management`, `output_config`, `metadata`,
`?beta=true`) ignored, `thinking.budget_tokens` an upper bound on the reasoning
(thinking_budget.py), `tool_choice` any / tool forcing the call (chat.build_prompt).
`count_tokens` renders through the same path, so it is the prompt the request prefills.
"""

from __future__ import annotations

import json
import uuid
from typing import AsyncIterator, List, Optional, Tuple

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse

from ..engine.request import Request
from .chat import Prompt, anthropic_messages, anthropic_tools, build_prompt
from .errors import APIError
from .generation import Generation, finish_error, output_budget
from .openai_api import SSE_HEADERS, _collect, _guarded
from .thinking_budget import add_budget
from .validation import (
    anthropic_tool_choice,
    field,
    num_draft,
    parse_json_body,
    sampling_params,
    string_list,
)


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _stop_reason(gen: Generation) -> str:
    if gen.finish_reason == "length":
        return "max_tokens"
    if gen.tool_calls():
        return "tool_use"
    if gen.stop_sequence() is not None:
        return "stop_sequence"
    return "end_turn"


def _usage(gen: Generation) -> dict:
    return {"input_tokens": gen.prompt_tokens, "output_tokens": gen.completion_tokens,
            "cache_read_input_tokens": gen.stats.cached_prompt_tokens if gen.stats else 0,
            "mtp": gen.mtp_usage()}


def _tool_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def _thinking(body: dict) -> Tuple[Optional[bool], Optional[int]]:
    """-> (enable_thinking for the template, None: its default; the reasoning budget or None)."""
    thinking = field(body, "thinking", dict)
    if thinking is None:
        return None, None
    kind = thinking.get("type")
    if kind == "enabled":
        return True, field(thinking, "budget_tokens", int, minimum=1, label="thinking.budget_tokens")
    if kind == "adaptive":
        return True, None
    if kind == "disabled":
        return False, None
    raise APIError(400, "thinking.type: must be 'enabled', 'adaptive' or 'disabled'")


def _check_model(state, body: dict) -> str:
    """The model name the response reports: the one the client asked for."""
    model = field(body, "model", str, required=True)
    if not state.knows_model(model):
        raise APIError(404, f"model: {model} (this server serves '{state.model_id}')")
    return model


def _conversation(state, body: dict) -> Tuple[Prompt, Optional[List[dict]]]:
    """-> (the prompt, the tools the model sees). Shared by messages and count_tokens."""
    _check_model(state, body)
    if "messages" not in body:
        raise APIError(400, "messages: field required")
    msgs = anthropic_messages(body.get("system"), body["messages"])
    tools = anthropic_tools(body.get("tools"))
    choice = anthropic_tool_choice(body, tools)
    if choice == "none":
        tools = None
    prompt = build_prompt(state.tok, msgs, tools, _thinking(body)[0], tool_choice=choice)
    return prompt, tools


def _prepare(state, raw: bytes):
    """Body -> (Generation, stream?): validation and templating, run off the event loop.
    Unknown fields (beta features such as context_management, output_config) are ignored."""
    body = parse_json_body(raw)
    max_tokens = field(body, "max_tokens", int, required=True, minimum=1)
    prompt, tools = _conversation(state, body)
    stop = string_list(body, "stop_sequences")
    stream = field(body, "stream", bool, default=False)
    params = sampling_params(body, state.vocab_size, anthropic=True)
    ids = prompt.ids
    req = Request(prompt=ids, max_tokens=output_budget(state, len(ids), max_tokens, anthropic=True), params=params,
                  stop=stop, num_draft=num_draft(body))
    if not prompt.opening:  # a forced tool call has no reasoning to bound
        add_budget(req, state.tok, _thinking(body)[1], prompt.in_think)
    gen = Generation(state, req, splitter=prompt.splitter(tools), body=body)
    return gen, stream


async def messages(request: HTTPRequest):
    state = request.app.state.server
    gen, stream = await state.off_loop(_prepare, state, await request.body())
    gen.start()
    mid = "msg_" + uuid.uuid4().hex[:24]
    model = gen.body["model"]  # answered under the name the client used
    if stream:
        return StreamingResponse(_guarded(gen, _stream(gen, mid, model)), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    await _collect(gen, request)
    if gen.error:
        raise finish_error(gen)
    content: List[dict] = []
    for kind, value in gen.pieces:
        if kind == "reasoning":
            content.append({"type": "thinking", "thinking": value, "signature": ""})
        elif kind == "content":
            content.append({"type": "text", "text": value})
        else:
            content.append({"type": "tool_use", "id": _tool_id(), "name": value["name"], "input": value["arguments"]})
    return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": model,
                         "content": _merge_blocks(content), "stop_reason": _stop_reason(gen),
                         "stop_sequence": gen.stop_sequence(), "usage": _usage(gen)})


def _count(state, raw: bytes) -> int:
    return len(_conversation(state, parse_json_body(raw))[0].ids)


async def count_tokens(request: HTTPRequest):
    """POST /v1/messages/count_tokens (Claude Code calls it): the rendered prompt's length."""
    state = request.app.state.server
    return JSONResponse({"input_tokens": await state.off_loop(_count, state, await request.body())})


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


async def _stream(gen: Generation, mid: str, model: str) -> AsyncIterator[str]:
    yield _event("message_start", {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": 0}}})
    yield _event("ping", {"type": "ping"})
    index, open_kind = -1, None

    def close():
        return _event("content_block_stop", {"type": "content_block_stop", "index": index})

    async for pieces, ev in gen.updates(keepalive=True):
        if ev is None:  # no token yet (a long prefill): keep the connection alive
            yield _event("ping", {"type": "ping"})
            continue
        for kind, value in pieces:
            if kind == "tool_call":
                if open_kind is not None:
                    yield close()
                index += 1
                yield _event("content_block_start", {"type": "content_block_start", "index": index, "content_block": {
                    "type": "tool_use", "id": _tool_id(), "name": value["name"], "input": {}}})
                yield _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(value["arguments"], ensure_ascii=False)}})
                yield close()
                open_kind = None
                continue
            if kind != open_kind:
                if open_kind is not None:
                    yield close()
                index += 1
                open_kind = kind
                block = {"type": "text", "text": ""} if kind == "content" else \
                    {"type": "thinking", "thinking": "", "signature": ""}
                yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                     "content_block": block})
            delta = {"type": "text_delta", "text": value} if kind == "content" else \
                {"type": "thinking_delta", "thinking": value}
            yield _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
        if ev.finish_reason is not None:
            if open_kind is not None:
                yield close()
                open_kind = None
            if gen.error:
                yield _event("error", {"type": "error", "error": {"type": "api_error", "message": gen.error}})
                return
            yield _event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": _stop_reason(gen),
                                                     "stop_sequence": gen.stop_sequence()},
                                           "usage": {"output_tokens": gen.completion_tokens, "mtp": gen.mtp_usage()}})
            yield _event("message_stop", {"type": "message_stop"})
