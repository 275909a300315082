"""OpenAI-compatible endpoints: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator, List, Optional

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse

from ..engine.limits import MAX_TOP_LOGPROBS
from ..engine.request import Request
from .chat import build_prompt, encode_prompt, openai_messages, openai_tools
from .errors import APIError
from .generation import Generation, finish_error, output_budget
from .validation import (
    field,
    num_draft,
    openai_tool_choice,
    parse_json_body,
    sampling_params,
    string_list,
    token_ids,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it, the connection sees traffic


def _sse(obj) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)) + "\n\n"


def check_model(state, body: dict) -> str:
    """The model name the response reports: the one the client asked for."""
    model = field(body, "model", str, required=True)
    if not state.knows_model(model):
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{state.model_id}'",
                       param="model", code="model_not_found")
    return model


def _max_tokens(body: dict) -> Optional[int]:
    value = field(body, "max_completion_tokens", int, minimum=1)
    return value if value is not None else field(body, "max_tokens", int, minimum=1)


def _stream_flags(body: dict):
    stream = field(body, "stream", bool, default=False)
    opts = field(body, "stream_options", dict, default={})
    include_usage = bool(field(opts, "include_usage", bool, default=False, label="stream_options.include_usage"))
    return stream, include_usage


def _usage(gen: Generation) -> dict:
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": gen.stats.cached_prompt_tokens if gen.stats else 0},
            "mtp": gen.mtp_usage()}


def _finish(gen: Generation) -> str:
    if gen.finish_reason == "stop" and gen.tool_calls():
        return "tool_calls"
    return gen.finish_reason if gen.finish_reason in ("stop", "length") else "stop"


def _chat_logprobs(tok, lps: List[dict]) -> dict:
    def entry(token: int, logprob: float) -> dict:
        s = tok.decode([token])
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {"content": [dict(entry(e["token"], e["logprob"]), top_logprobs=[entry(t, lp) for t, lp in e["top"]])
                        for e in lps]}


def _tool_call_obj(call: dict) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}


async def _guarded(gen: Generation, agen: AsyncIterator[str]) -> AsyncIterator[str]:
    """Close the generation's iterator however the stream ends (a disconnect cancels us)."""
    try:
        async for chunk in agen:
            yield chunk
    finally:
        await agen.aclose()
        gen.abandon()


async def _collect(gen: Generation, request: HTTPRequest) -> None:
    """Run to the end; if the client leaves first, cancel (frees the batch slot)."""
    import asyncio

    async def watch():
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)

    runner = asyncio.ensure_future(gen.run())
    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({runner, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if runner not in done:
            runner.cancel()  # Generation.updates' finally cancels the request
            try:
                await runner
            except asyncio.CancelledError:
                pass
            raise APIError(499, "client disconnected")
        runner.result()
    finally:
        watcher.cancel()


# ------------------------------------------------------------------ handlers
def _model_card(state, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "mlxmtp",
            "root": state.model_id, "mtp": {"active": state.mtp_active, "disabled_reason": state.mtp_disabled_reason}}


async def list_models(request: HTTPRequest):
    state = request.app.state.server
    return JSONResponse({"object": "list", "data": [_model_card(state, n) for n in state.model_names()]})


async def get_model(request: HTTPRequest):
    state = request.app.state.server
    name = request.path_params["model_id"]
    if not state.knows_model(name):
        raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
    return JSONResponse(_model_card(state, name))


def _prepare_chat(state, raw: bytes):
    """Body -> (Generation, options): validation and templating, run off the event loop."""
    body = parse_json_body(raw)
    model = check_model(state, body)
    if "messages" not in body:
        raise APIError(400, "'messages' is a required field", param="messages")
    messages = openai_messages(body["messages"])
    tools = openai_tools(body.get("tools"))
    choice = openai_tool_choice(body, tools)
    if choice == "none":
        tools = None
    if field(body, "n", int, default=1, minimum=1) != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    kwargs = dict(field(body, "chat_template_kwargs", dict, default={}))
    thinking = field(body, "enable_thinking", bool)
    if thinking is None and "enable_thinking" in kwargs:
        thinking = field(kwargs, "enable_thinking", bool, label="chat_template_kwargs.enable_thinking")
    kwargs.pop("enable_thinking", None)
    want_lp = field(body, "logprobs", bool, default=False)
    top_n = field(body, "top_logprobs", int, minimum=0, maximum=MAX_TOP_LOGPROBS)
    if top_n and not want_lp:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    stream, include_usage = _stream_flags(body)
    params = sampling_params(body, state.vocab_size)
    prompt = build_prompt(state.tok, messages, tools, thinking, kwargs, tool_choice=choice)
    ids = prompt.ids
    req = Request(prompt=ids, max_tokens=output_budget(state, len(ids), _max_tokens(body)), params=params,
                  stop=string_list(body, "stop"), logprobs=(top_n or 0) if want_lp else None, num_draft=num_draft(body))
    gen = Generation(state, req, splitter=prompt.splitter(tools), body=body)
    return gen, dict(model=model, stream=stream, include_usage=include_usage, want_lp=want_lp)


async def chat_completions(request: HTTPRequest):
    state = request.app.state.server
    gen, opt = await state.off_loop(_prepare_chat, state, await request.body())
    gen.start()
    cid = "chatcmpl-" + uuid.uuid4().hex[:24]
    created, model, want_lp = int(time.time()), opt["model"], opt["want_lp"]
    if opt["stream"]:
        return StreamingResponse(_guarded(gen, _chat_stream(state, gen, cid, created, model, want_lp,
                                                            opt["include_usage"])),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    await _collect(gen, request)
    if gen.error:
        raise finish_error(gen)
    calls = [_tool_call_obj(c) for c in gen.tool_calls()]
    message = {"role": "assistant", "content": gen.content() if (gen.content() or not calls) else None}
    if gen.reasoning():
        message["reasoning_content"] = gen.reasoning()
    if calls:
        message["tool_calls"] = calls
    choice = {"index": 0, "message": message, "finish_reason": _finish(gen),
              "logprobs": _chat_logprobs(state.tok, gen.logprobs) if want_lp else None}
    return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model,
                         "choices": [choice], "usage": _usage(gen)})


async def _chat_stream(state, gen: Generation, cid: str, created: int, model: str, want_lp: bool,
                       include_usage: bool) -> AsyncIterator[str]:
    def chunk(delta: dict, finish: Optional[str] = None, logprobs=None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        if want_lp:
            choice["logprobs"] = logprobs
        return _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [choice]})

    yield chunk({"role": "assistant", "content": ""})
    n_calls = 0
    async for pieces, ev in gen.updates(keepalive=True):
        if ev is None:
            yield KEEPALIVE
            continue
        deltas = []
        for kind, value in pieces:
            if kind == "content":
                deltas.append({"content": value})
            elif kind == "reasoning":
                deltas.append({"reasoning_content": value})
            else:
                call = _tool_call_obj(value)
                # Clients assemble calls from deltas: id/name first, then the arguments.
                deltas.append({"tool_calls": [{"index": n_calls, "id": call["id"], "type": "function",
                                               "function": {"name": call["function"]["name"], "arguments": ""}}]})
                deltas.append({"tool_calls": [{"index": n_calls,
                                               "function": {"arguments": call["function"]["arguments"]}}]})
                n_calls += 1
        lp = _chat_logprobs(state.tok, ev.logprobs) if (want_lp and ev.logprobs) else None
        if lp is not None and not deltas:
            deltas.append({"content": ""})
        for i, d in enumerate(deltas):
            yield chunk(d, logprobs=lp if i == 0 else None)
        if ev.finish_reason is not None:
            if gen.error:
                yield _sse({"error": {"message": gen.error, "type": "server_error", "param": None, "code": None}})
                break
            yield chunk({}, finish=_finish(gen))
            if include_usage:
                yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": _usage(gen)})
    yield _sse("[DONE]")


def _prepare_completion(state, raw: bytes):
    body = parse_json_body(raw)
    model = check_model(state, body)
    if "prompt" not in body:
        raise APIError(400, "'prompt' is a required field", param="prompt")
    ids = token_ids(encode_prompt(state.tok, body["prompt"]), state.vocab_size, "prompt")
    if field(body, "n", int, default=1, minimum=1) != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    if field(body, "echo", bool, default=False):
        raise APIError(400, "echo is not supported", param="echo")
    lp_n = field(body, "logprobs", int, minimum=0, maximum=5)
    stream, include_usage = _stream_flags(body)
    params = sampling_params(body, state.vocab_size)
    max_tokens = output_budget(state, len(ids), field(body, "max_tokens", int, minimum=1, default=16),
                               param="prompt")
    req = Request(prompt=ids, max_tokens=max_tokens, params=params, stop=string_list(body, "stop"),
                  logprobs=lp_n, num_draft=num_draft(body))
    return Generation(state, req, splitter=None, body=body), dict(model=model, stream=stream,
                                                                  include_usage=include_usage, lp_n=lp_n)


async def completions(request: HTTPRequest):
    state = request.app.state.server
    gen, opt = await state.off_loop(_prepare_completion, state, await request.body())
    gen.start()
    cid = "cmpl-" + uuid.uuid4().hex[:24]
    created, model, lp_n = int(time.time()), opt["model"], opt["lp_n"]
    if opt["stream"]:
        return StreamingResponse(_guarded(gen, _completion_stream(state, gen, cid, created, model, lp_n,
                                                                  opt["include_usage"])),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    await _collect(gen, request)
    if gen.error:
        raise finish_error(gen)
    choice = {"index": 0, "text": gen.content(), "finish_reason": _finish(gen),
              "logprobs": _completion_logprobs(state.tok, gen.logprobs) if lp_n is not None else None}
    return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                         "choices": [choice], "usage": _usage(gen)})


def _completion_logprobs(tok, lps: List[dict], offset: int = 0) -> dict:
    tokens, values, offsets = [], [], []
    for e in lps:
        s = tok.decode([e["token"]])
        tokens.append(s)
        values.append(e["logprob"])
        offsets.append(offset)
        offset += len(s)
    tops = [{tok.decode([t]): lp for t, lp in e["top"]} for e in lps]
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


async def _completion_stream(state, gen: Generation, cid: str, created: int, model: str, lp_n, include_usage: bool):
    def chunk(text: str, finish: Optional[str] = None, logprobs=None) -> str:
        return _sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                     "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}]})

    async for pieces, ev in gen.updates(keepalive=True):
        if ev is None:
            yield KEEPALIVE
            continue
        text = "".join(v for _, v in pieces)
        lp = _completion_logprobs(state.tok, ev.logprobs) if (lp_n is not None and ev.logprobs) else None
        if text or lp:
            yield chunk(text, logprobs=lp)
        if ev.finish_reason is not None:
            if gen.error:
                yield _sse({"error": {"message": gen.error, "type": "server_error", "param": None, "code": None}})
                break
            yield chunk("", finish=_finish(gen))
            if include_usage:
                yield _sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": _usage(gen)})
    yield _sse("[DONE]")
