"""One request's run through the engine bridge, its output split into content /
reasoning / tool calls, and the output budget every API gives a prompt."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, List, Optional, Tuple

from ..engine.request import Event, Request
from .errors import APIError
from .reasoning import OutputSplitter, Piece
from .tool_parsers import TOOL_CALL_END

# A stream with no new token (a long prefill, waiting for a batch slot, or a request
# that waits for memory to resume: engine/memory.py) sends a keep-alive this often:
# clients and proxies drop a connection silent for long (Claude Code's stream watchdog,
# nginx's 60 s read timeout). Read at run time: tests shorten it.
KEEPALIVE_SECONDS = 5.0


def context_error(state, n_prompt: int, anthropic: bool, param: str = "messages") -> APIError:
    """The prompt leaves no room for output: each API's own wording, which clients parse
    (Claude Code reads Anthropic's "prompt is too long: N tokens > M maximum")."""
    limit = min(state.context_length - 1, state.max_prompt_tokens or state.context_length)
    if anthropic:
        return APIError(400, f"prompt is too long: {n_prompt} tokens > {limit} maximum")
    return APIError(400, f"This model's maximum context length is {state.context_length} tokens. However, your "
                         f"messages resulted in {n_prompt} tokens, more than the {limit} a prompt may have. "
                         "Please reduce the length of the messages.", param=param,
                    code="context_length_exceeded")


def output_budget(state, n_prompt: int, requested, anthropic: bool = False, param: str = "messages") -> int:
    """max_tokens for a prompt of n_prompt tokens: the request's (else the server's default,
    --max-tokens), capped at the room left in the context (the room left when neither is
    set); a prompt that leaves none is a 400."""
    room = state.context_length - n_prompt
    if room < 1 or (state.max_prompt_tokens and n_prompt > state.max_prompt_tokens):
        raise context_error(state, n_prompt, anthropic, param)
    if requested is None:
        requested = state.default_max_tokens
    return room if requested is None else min(requested, room)


class Generation:
    """One request in flight. Iterate it for (pieces, event) updates; afterwards its
    fields hold the totals. Leaving the iteration early (client gone) cancels it."""

    def __init__(self, state, req: Request, *, splitter: Optional[OutputSplitter], body: dict):
        self.state = state
        self.req = req
        self.splitter = splitter
        self.body = body
        self.t0 = time.perf_counter()
        self.raw_text = ""
        self.token_ids: List[int] = []
        self.logprobs: List[dict] = []
        self.finish_reason: Optional[str] = None
        self.stop: Optional[str] = None  # the stop string that ended it (engine Event.stop)
        self.own_stops: set = set()  # stop strings the server added (not the client's: not reported)
        self.error: Optional[str] = None
        self.error_param: Optional[str] = None  # the request's field that failed it (Event.error_param)
        self.stats = None
        self.pieces: List[Piece] = []

    def start(self) -> None:
        """Submit to the engine; errors here are the client's (400)."""
        st = self.state
        if st.request_hook is not None:
            st.request_hook(self.req, self.body)
        try:
            self.queue = st.bridge.submit(self.req)
        except ValueError as e:
            raise APIError(400, str(e)) from e

    async def _next(self, keepalive: bool) -> Optional[Event]:
        """The next engine event; None when `keepalive` and KEEPALIVE_SECONDS passed without one."""
        if not keepalive:
            return await self.queue.get()
        try:
            return await asyncio.wait_for(self.queue.get(), KEEPALIVE_SECONDS)
        except asyncio.TimeoutError:  # the event stays queued: a cancelled get takes nothing
            return None

    async def updates(self, keepalive: bool = False) -> AsyncIterator[Tuple[List[Piece], Optional[Event]]]:
        """(pieces, event) per engine event; with `keepalive`, ([], None) each KEEPALIVE_SECONDS
        without one (a long prefill, waiting for a batch slot or for memory): the stream sends
        its API's keep-alive then."""
        last = None  # when the previous tokens came
        try:
            while True:
                ev = await self._next(keepalive)
                if ev is None:
                    yield [], None
                    continue
                if ev.token_ids:
                    last = self._observe_latency(ev, last)
                pieces = self._absorb(ev)
                yield pieces, ev
                if ev.finish_reason is not None:
                    return
        finally:
            if self.finish_reason is None:
                # The client went away (or the handler failed): free the slot.
                self.state.bridge.cancel(self.req.id)

    def _observe_latency(self, ev: Event, last: Optional[float]) -> float:
        """Time to first token, or the inter-token latency spread over the event's tokens."""
        metrics = self.state.metrics
        now = time.perf_counter()
        if last is None:
            metrics.ttft.observe(now - self.t0)
        else:
            per = (now - last) / len(ev.token_ids)
            for _ in ev.token_ids:
                metrics.itl.observe(per)
        return now

    def _absorb(self, ev: Event) -> List[Piece]:
        """Add the event to the totals; -> its output split into pieces."""
        self.token_ids += ev.token_ids
        self.raw_text += ev.text
        if ev.logprobs:
            self.logprobs += ev.logprobs
        pieces: List[Piece] = []
        if ev.finish_reason == "error":
            self.error, self.error_param = ev.error or "generation failed", ev.error_param
        if self.splitter is None:
            if ev.text:
                pieces.append(("content", ev.text))
        else:
            pieces += self.splitter.feed(ev.text)
            if ev.finish_reason is not None:
                pieces += self.splitter.finish()
        self.pieces += pieces
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason
            self.stats = ev.stats
            self.stop = ev.stop
        return pieces

    def abandon(self) -> None:
        """The consumer is gone: cancel unless finished (idempotent; cancel of a finished id is a no-op)."""
        if self.finish_reason is None:
            self.state.bridge.cancel(self.req.id)

    async def run(self) -> None:
        async for _ in self.updates():
            pass

    # ------------------------------------------------------------------ results
    @property
    def prompt_tokens(self) -> int:
        return len(self.req.prompt)

    @property
    def completion_tokens(self) -> int:
        return self.stats.generated_tokens if self.stats is not None else len(self.token_ids)

    def mtp_usage(self) -> dict:
        s = self.stats.as_dict() if self.stats is not None else {}
        return {k: s.get(k, 0) for k in ("drafted", "accepted", "acceptance", "acceptance_by_position",
                                          "tokens_per_forward", "forwards", "depths", "by_source")}

    def content(self) -> str:
        return "".join(v for k, v in self.pieces if k == "content")

    def reasoning(self) -> str:
        return "".join(v for k, v in self.pieces if k == "reasoning")

    def tool_calls(self) -> List[dict]:
        return [v for k, v in self.pieces if k == "tool_call"]

    def ended_on_eos(self) -> bool:
        stop_ids = self.req.stop_token_ids if self.req.stop_token_ids is not None else self.state.eos_ids
        return bool(self.token_ids) and self.token_ids[-1] in set(stop_ids)

    def stop_sequence(self) -> Optional[str]:
        """Which of the client's stop strings ended the output (None for EOS / length)."""
        return None if self.stop in self.own_stops else self.stop

    def one_tool_call(self) -> None:
        """At most one tool call (parallel_tool_calls false, disable_parallel_tool_use): the
        output ends where the first call closes (the splitter takes a call cut there)."""
        self.req.stop.append(TOOL_CALL_END)
        self.own_stops.add(TOOL_CALL_END)


def finish_error(gen: Generation) -> APIError:
    """The failed generation's error: a 400 naming the field whose content failed it, else a 500."""
    return APIError(400 if gen.error_param else 500, gen.error or "generation failed", param=gen.error_param)
