"""What every request handler reads: the served model's tokenizer and limits, the engine
bridge, the server's defaults (ServerState)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

from .engine_thread import EngineBridge
from .metrics import Metrics

# Request bodies over this are prepared in a lane of their own (ServerState.prepare): an
# agent's conversation of ~250K tokens, far beyond its usual requests.
LARGE_BODY = 1 << 20


@dataclass
class ServerState:
    tok: object
    model_id: str
    bridge: EngineBridge
    metrics: Metrics
    eos_ids: set
    mtp_active: bool
    mtp_disabled_reason: Optional[str]
    vocab_size: int
    context_length: int  # prompt + output tokens a request may reach
    max_prompt_tokens: Optional[int] = None
    aliases: set = field(default_factory=set)
    strict_model_name: bool = False  # True: unknown model names get 404
    request_hook: Optional[Callable] = None  # tests: (engine Request, body) before submit
    sampling_defaults: dict = field(default_factory=dict)  # for fields a request leaves unset ({}: greedy)
    chat_template_args: dict = field(default_factory=dict)  # template variables a request may override
    default_max_tokens: Optional[int] = None  # output limit of requests that set none (None: the context's end)
    constrain_tool_calls: bool = False  # hold every call the model opens to its grammar (structured_output)
    created: int = field(default_factory=lambda: int(time.time()))
    # Parsing, validating, templating and tokenising run off the event loop, in two lanes of
    # one thread each (see `prepare`).
    prep_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="mlxmtp-prep"))
    large_prep_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="mlxmtp-prep-large"))
    _large_view: Optional["ServerState"] = field(default=None, repr=False)

    async def prepare(self, fn: Callable, raw: bytes):
        """fn(state, raw) off the event loop. A body over LARGE_BODY goes to a lane of its own
        with its own copy of the tokenizer, so that a huge prompt (seconds to tokenize, and
        maybe refused at the end) never holds up the requests behind it. One thread a lane:
        a fast tokenizer must not be used from two at once."""
        loop = asyncio.get_running_loop()
        if len(raw) <= LARGE_BODY:
            return await loop.run_in_executor(self.prep_pool, fn, self, raw)
        return await loop.run_in_executor(self.large_prep_pool, self._prepare_large, fn, raw)

    def _prepare_large(self, fn: Callable, raw: bytes):
        if self._large_view is None:  # on the large lane's thread, once: no other thread sets it
            self._large_view = dataclasses.replace(self, tok=copy.deepcopy(self.tok))
        return fn(self._large_view, raw)

    def knows_model(self, name: str) -> bool:
        # Agents send names of their own (claude-sonnet-..., gpt-5-codex): one model is
        # served, so any name is answered unless --strict-model-name ("*" in --alias
        # accepts any name even then).
        if not self.strict_model_name:
            return True
        return name == self.model_id or name in self.aliases or "*" in self.aliases

    def template_kwargs(self, request_kwargs: Optional[dict] = None) -> dict:
        """The chat template's variables for a request: the server's, then the request's own."""
        return {**self.chat_template_args, **(request_kwargs or {})}

    def model_names(self) -> list:
        """What /v1/models lists: the served model, then its aliases."""
        return [self.model_id] + sorted(a for a in self.aliases if a not in ("*", self.model_id))
