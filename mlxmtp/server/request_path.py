"""The one path every generating endpoint takes: body -> Generation -> stream or response.

An API module supplies two things: a `prepare(state, raw_body)` that parses and validates
its body and returns `(Generation, Reply)` (run off the event loop: templating and
tokenising take a while), and that `Reply`: its output format, as stream events and as
a collected response. `handle` does the rest the same way for every API: submit to the
engine, then either stream (cancelling the request if the client leaves) or run to the
end and answer with one JSON body.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable, Dict, Iterable, List, Optional, Tuple

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine.request import Event, Request
from ..engine.sampling.params import SamplingParams
from .errors import APIError
from .generation import Generation, finish_error, output_budget
from .reasoning import OutputSplitter, Piece
from .validation import field, num_draft

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it, the connection sees traffic


def sse_data(obj) -> str:
    """A `data:` line (OpenAI streams): a JSON object, or a bare string such as [DONE]."""
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)) + "\n\n"


def sse_event(name: str, data: dict) -> str:
    """An `event:` / `data:` pair (Anthropic and Responses streams)."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


# ------------------------------------------------------------------ request side
def check_model(state, body: dict, *, anthropic: bool = False) -> str:
    """The model name the response reports: the one the client asked for. An unknown
    name (only with --strict-model-name) is a 404 in each API's own wording."""
    model = field(body, "model", str, required=True)
    if not state.knows_model(model):
        if anthropic:
            raise APIError(404, f"model: {model} (this server serves '{state.model_id}')")
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{state.model_id}'",
                       param="model", code="model_not_found")
    return model


def new_generation(state, body: dict, prompt: List[int], requested: Optional[int], params: SamplingParams,
                   splitter: Optional[OutputSplitter], *, stop: Optional[list] = None,
                   logprobs: Optional[int] = None, anthropic: bool = False,
                   param: str = "messages", shared_prefix: int = 0) -> Generation:
    """The engine Request for a rendered prompt: `requested` output tokens capped at the
    room left in the context (a prompt that leaves none is a 400 in the API's wording,
    naming `param`), and its Generation (not yet submitted). `shared_prefix`: see Request."""
    max_tokens = output_budget(state, len(prompt), requested, anthropic=anthropic, param=param)
    req = Request(prompt=prompt, max_tokens=max_tokens, params=params, stop=stop or [], logprobs=logprobs,
                  num_draft=num_draft(body), shared_prefix=shared_prefix)
    return Generation(state, req, splitter=splitter, body=body)


# ------------------------------------------------------------------ output side
class Reply:
    """One API's output for one request. Streaming: `opening`, then per engine update
    `update` (or `keepalive` while no token comes), `finish` at the end (which also
    reports a generation error in the API's shape), then `closing`. Not streaming:
    `response` builds the body from the finished Generation."""

    stream: bool = False
    headers: Dict[str, str] = {}

    def opening(self, gen: Generation) -> Iterable[str]:
        return ()

    def keepalive(self) -> str:
        return KEEPALIVE

    def update(self, gen: Generation, pieces: List[Piece], ev: Event) -> Iterable[str]:
        raise NotImplementedError

    def finish(self, gen: Generation) -> Iterable[str]:
        raise NotImplementedError

    def closing(self) -> Iterable[str]:
        return ()

    def response(self, gen: Generation) -> dict:
        raise NotImplementedError


Prepare = Callable[[object, bytes], Tuple[Generation, Reply]]


async def handle(request: HTTPRequest, prepare: Prepare) -> Response:
    """The handler body every generating endpoint shares."""
    state = request.app.state.server
    gen, reply = await state.prepare(prepare, await request.body())
    gen.start()
    if reply.stream:
        return StreamingResponse(guarded(gen, events(gen, reply)), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **reply.headers})
    await collect(gen, request)
    if gen.error:
        raise finish_error(gen)
    return JSONResponse(reply.response(gen), headers=reply.headers)


async def events(gen: Generation, reply: Reply) -> AsyncIterator[str]:
    """The stream: the Reply's events around the Generation's updates."""
    for chunk in reply.opening(gen):
        yield chunk
    async for pieces, ev in gen.updates(keepalive=True):
        if ev is None:  # no token for a while (a long prefill): keep the connection alive
            yield reply.keepalive()
            continue
        for chunk in reply.update(gen, pieces, ev):
            yield chunk
        if ev.finish_reason is not None:
            for chunk in reply.finish(gen):
                yield chunk
    for chunk in reply.closing():
        yield chunk


async def guarded(gen: Generation, agen: AsyncIterator[str]) -> AsyncIterator[str]:
    """Close the generation's iterator however the stream ends (a disconnect cancels us)."""
    try:
        async for chunk in agen:
            yield chunk
    finally:
        await agen.aclose()
        gen.abandon()


async def collect(gen: Generation, request: HTTPRequest) -> None:
    """Run to the end; if the client leaves first, cancel (frees the batch slot)."""

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
