"""OpenAI-compatible endpoints: /v1/models, /v1/chat/completions, /v1/completions.

Each generating endpoint is its body parsing (`_prepare_*`) and its output format (a
request_path.Reply); request_path.handle runs the request between the two. Chat messages
and tools are read in openai_input.py; what both replies share is in openai_reply.py.
"""

from __future__ import annotations

import json
import uuid
from typing import List, Optional, Tuple

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from ..mlxlm.token_text import token_bytes
from .answer_hold import hold_to_format
from .chat import (
    RENDERING_ARGUMENTS,
    TEMPLATE_FUNCTIONS,
    build_prompt,
    effort_thinking,
    encode_prompt,
)
from .errors import APIError
from .generation import Generation
from .openai_input import openai_messages, openai_tools, strict_tools
from .openai_reply import OpenAIReply, finish_reason, usage
from .request_path import check_model, handle, new_generation, sse_data
from .validation import (
    field,
    openai_tool_choice,
    parse_json_body,
    sampling_params,
    string_list,
    token_ids,
    top_logprobs,
)

# A completion's max_tokens when the request sets none and the server no default: OpenAI's.
COMPLETION_TOKENS = 16


# ------------------------------------------------------------------ models
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


# ------------------------------------------------------------------ shared by both completions APIs
def _stream_flags(body: dict) -> Tuple[bool, bool]:
    """-> (stream, stream_options.include_usage)."""
    stream = field(body, "stream", bool, default=False)
    opts = field(body, "stream_options", dict, default={})
    include_usage = bool(field(opts, "include_usage", bool, default=False, label="stream_options.include_usage"))
    return stream, include_usage


def _check_n(body: dict) -> None:
    if field(body, "n", int, default=1, minimum=1) != 1:
        raise APIError(400, "only n=1 is supported", param="n")


# ------------------------------------------------------------------ chat completions
def _chat_logprobs(tok, lps: List[dict]) -> dict:
    def entry(token: int, logprob: float) -> dict:
        return {"token": tok.decode([token]), "logprob": logprob, "bytes": list(token_bytes(tok, token))}

    return {"content": [dict(entry(e["token"], e["logprob"]), top_logprobs=[entry(t, lp) for t, lp in e["top"]])
                        for e in lps]}


def _tool_call_obj(call: dict) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}


class ChatReply(OpenAIReply):
    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"

    def __init__(self, state, model: str, stream: bool, include_usage: bool, want_lp: bool):
        super().__init__(state, model, stream, include_usage)
        self.want_lp = want_lp
        self.n_calls = 0

    def chunk(self, delta: dict, finish: Optional[str] = None, logprobs=None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        if self.want_lp:
            choice["logprobs"] = logprobs
        return sse_data(self.envelope(self.chunk_object, [choice]))

    def opening(self, gen: Generation) -> List[str]:
        return [self.chunk({"role": "assistant", "content": ""})]

    def keepalive(self) -> str:
        """A chunk of no text, not a comment: agents' OpenAI SDKs skip SSE comments, and some
        abort a stream that sent no data for a while (Qwen Code: 240 s) and retry it, which a
        long prompt's prefill outlasts."""
        return self.chunk({"content": ""})

    def update(self, gen: Generation, pieces, ev) -> List[str]:
        deltas = [delta for kind, value in pieces for delta in self._deltas(kind, value)]
        lp = _chat_logprobs(self.tok, ev.logprobs) if (self.want_lp and ev.logprobs) else None
        if lp is not None and not deltas:
            deltas.append({"content": ""})
        return [self.chunk(d, logprobs=lp if i == 0 else None) for i, d in enumerate(deltas)]

    def _deltas(self, kind: str, value) -> List[dict]:
        if kind == "content":
            return [{"content": value}]
        if kind == "reasoning":
            return [{"reasoning_content": value}]
        call = _tool_call_obj(value)
        index = self.n_calls
        self.n_calls += 1
        # Clients assemble calls from deltas: id/name first, then the arguments.
        return [{"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                 "function": {"name": call["function"]["name"], "arguments": ""}}]},
                {"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]}]

    def final_chunk(self, gen: Generation) -> str:
        return self.chunk({}, finish=finish_reason(gen))

    def response(self, gen: Generation) -> dict:
        calls = [_tool_call_obj(c) for c in gen.tool_calls()]
        message = {"role": "assistant", "content": gen.content() if (gen.content() or not calls) else None}
        if gen.reasoning():
            message["reasoning_content"] = gen.reasoning()
        if calls:
            message["tool_calls"] = calls
        choice = {"index": 0, "message": message, "finish_reason": finish_reason(gen),
                  "logprobs": _chat_logprobs(self.tok, gen.logprobs) if self.want_lp else None}
        return self.envelope("chat.completion", [choice], usage=usage(gen))


def _template_options(tok, body: dict) -> Tuple[Optional[bool], dict]:
    """-> (enable_thinking, the other chat_template_kwargs). `enable_thinking` may come at
    the top level or inside chat_template_kwargs (the top level wins), else from OpenAI's
    `reasoning_effort`."""
    kwargs = dict(field(body, "chat_template_kwargs", dict, default={}))
    for name in sorted(RENDERING_ARGUMENTS & set(kwargs)):
        raise APIError(400, f"'chat_template_kwargs.{name}' is not allowed: the request may set the "
                            "template's variables only (the model's own template is used)",
                       param="chat_template_kwargs")
    for name in sorted(TEMPLATE_FUNCTIONS & set(kwargs)):
        raise APIError(400, f"'chat_template_kwargs.{name}' is not allowed: the template calls a function of "
                            "that name", param="chat_template_kwargs")
    thinking = field(body, "enable_thinking", bool)
    if thinking is None and "enable_thinking" in kwargs:
        thinking = field(kwargs, "enable_thinking", bool, label="chat_template_kwargs.enable_thinking")
    kwargs.pop("enable_thinking", None)
    if thinking is None:
        thinking = effort_thinking(tok, field(body, "reasoning_effort", str), "reasoning_effort")
    return thinking, kwargs


def _chat_logprob_fields(body: dict) -> Tuple[bool, Optional[int]]:
    """-> (logprobs wanted, top_logprobs)."""
    want_lp = field(body, "logprobs", bool, default=False)
    top_n = top_logprobs(body)
    if top_n and not want_lp:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return want_lp, top_n


def _prepare_chat(state, raw: bytes) -> Tuple[Generation, ChatReply]:
    body = parse_json_body(raw)
    model = check_model(state, body)
    if "messages" not in body:
        raise APIError(400, "'messages' is a required field", param="messages")
    messages = openai_messages(body["messages"])
    tools = openai_tools(body.get("tools"))
    choice = openai_tool_choice(body, tools)
    if choice == "none":
        tools = None
    _check_n(body)
    thinking, kwargs = _template_options(state.tok, body)
    want_lp, top_n = _chat_logprob_fields(body)
    stream, include_usage = _stream_flags(body)
    params = sampling_params(body, state.vocab_size, defaults=state.sampling_defaults)
    prompt = build_prompt(state.tok, messages, tools, thinking, state.template_kwargs(kwargs), tool_choice=choice)
    max_tokens = field(body, "max_completion_tokens", int, minimum=1)
    if max_tokens is None:
        max_tokens = field(body, "max_tokens", int, minimum=1)
    gen = new_generation(state, body, prompt.ids, max_tokens, params, prompt.splitter(tools),
                         stop=string_list(body, "stop"), logprobs=(top_n or 0) if want_lp else None,
                         shared_prefix=prompt.shared)
    hold_to_format(gen.req, state.tok, body.get("response_format"), "response_format", prompt, tools,
                   strict_tools(tools), state.constrain_tool_calls)
    if field(body, "parallel_tool_calls", bool) is False and tools:
        gen.one_tool_call()
    return gen, ChatReply(state, model, stream, include_usage, want_lp)


async def chat_completions(request: HTTPRequest):
    return await handle(request, _prepare_chat)


# ------------------------------------------------------------------ text completions
def _completion_logprobs(tok, lps: List[dict], offset: int = 0) -> dict:
    """The legacy logprobs object; `offset`: where the first of these tokens starts in the
    completion's text (a stream's chunks continue from the one before)."""
    tokens, values, offsets, tops = [], [], [], []
    for e in lps:
        s = tok.decode([e["token"]])
        tokens.append(s)
        values.append(e["logprob"])
        offsets.append(offset)
        offset += len(s)
        # As OpenAI's: the sampled token is always among them (up to logprobs + 1 entries).
        tops.append({**{tok.decode([t]): lp for t, lp in e["top"]}, s: e["logprob"]})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


class CompletionReply(OpenAIReply):
    id_prefix = "cmpl-"
    chunk_object = "text_completion"

    def __init__(self, state, model: str, stream: bool, include_usage: bool, lp_n: Optional[int]):
        super().__init__(state, model, stream, include_usage)
        self.lp_n = lp_n
        self.text_offset = 0  # the next streamed token's text_offset

    def chunk(self, text: str, finish: Optional[str] = None, logprobs=None) -> str:
        return sse_data(self.envelope(self.chunk_object, [{"index": 0, "text": text, "finish_reason": finish,
                                                           "logprobs": logprobs}]))

    def update(self, gen: Generation, pieces, ev) -> List[str]:
        text = "".join(v for _, v in pieces)
        lp = None
        if self.lp_n is not None and ev.logprobs:
            lp = _completion_logprobs(self.tok, ev.logprobs, self.text_offset)
            self.text_offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return [self.chunk(text, logprobs=lp)] if (text or lp) else []

    def final_chunk(self, gen: Generation) -> str:
        return self.chunk("", finish=finish_reason(gen))

    def response(self, gen: Generation) -> dict:
        choice = {"index": 0, "text": gen.content(), "finish_reason": finish_reason(gen),
                  "logprobs": _completion_logprobs(self.tok, gen.logprobs) if self.lp_n is not None else None}
        return self.envelope("text_completion", [choice], usage=usage(gen))


def _prepare_completion(state, raw: bytes) -> Tuple[Generation, CompletionReply]:
    body = parse_json_body(raw)
    model = check_model(state, body)
    if "prompt" not in body:
        raise APIError(400, "'prompt' is a required field", param="prompt")
    ids = token_ids(encode_prompt(state.tok, body["prompt"]), state.vocab_size, "prompt")
    _check_n(body)
    if field(body, "echo", bool, default=False):
        raise APIError(400, "echo is not supported", param="echo")
    if field(body, "best_of", int, default=1, minimum=1) != 1:
        raise APIError(400, "only best_of=1 is supported", param="best_of")
    if field(body, "suffix", str):
        raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
    lp_n = field(body, "logprobs", int, minimum=0, maximum=5)
    stream, include_usage = _stream_flags(body)
    params = sampling_params(body, state.vocab_size, defaults=state.sampling_defaults)
    max_tokens = field(body, "max_tokens", int, minimum=1, default=state.default_max_tokens or COMPLETION_TOKENS)
    gen = new_generation(state, body, ids, max_tokens, params, None, stop=string_list(body, "stop"), logprobs=lp_n,
                         param="prompt")
    return gen, CompletionReply(state, model, stream, include_usage, lp_n)


async def completions(request: HTTPRequest):
    return await handle(request, _prepare_completion)
