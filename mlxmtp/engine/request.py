"""What a caller submits to the engine and what it gets back."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .limits import MAX_DRAFT_DEPTH, MAX_TOP_LOGPROBS
from .sampling.params import SamplingParams

_ids = itertools.count(1)


@dataclass
class Request:
    prompt: List[int]
    max_tokens: int = 256
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: List[str] = field(default_factory=list)
    stop_token_ids: Optional[List[int]] = None  # None: the tokenizer's EOS tokens
    num_draft: Optional[int] = None  # pin this request's depth (0 = no MTP)
    logprobs: Optional[int] = None  # None: none; 0: chosen token only; n: plus top n
    # Leading prompt tokens that other conversations share (the server's rendering of the system
    # prompt and tools): prefill stores the state there for them (see prefill).
    shared_prefix: int = 0
    id: int = field(default_factory=lambda: next(_ids))

    def validate(self, vocab_size: Optional[int] = None, max_depth: int = MAX_DRAFT_DEPTH) -> None:
        """Raise ValueError for anything that could fail inside the engine's step."""
        if not self.prompt:
            raise ValueError("the prompt is empty")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if vocab_size is not None and (min(self.prompt) < 0 or max(self.prompt) >= vocab_size):
            raise ValueError("prompt token id out of range")
        if self.num_draft is not None and not 0 <= self.num_draft <= max_depth:
            raise ValueError(f"num_draft must be in [0, {max_depth}]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        self.params.validate(vocab_size)


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    forwards: int = 0  # main-model decode forwards (prefill excluded)
    drafted: int = 0
    accepted: int = 0
    # Drafts by position in their cycle (the head's; a suffix draft's are not counted).
    drafted_by_position: List[int] = field(default_factory=list)
    accepted_by_position: List[int] = field(default_factory=list)
    # Per drafter ("mtp", "suffix"): [drafted, accepted].
    by_source: Dict[str, List[int]] = field(default_factory=dict)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    device_seconds: float = 0.0  # waiting on draft + verify (synchronous cycles)
    draft_seconds: float = 0.0  # drafting alone, when the engine profiles
    overhead_seconds: float = 0.0  # host: building graphs, bookkeeping (pipelined cycles: all)
    depths: Dict[int, int] = field(default_factory=dict)
    depth_reasons: Dict[str, int] = field(default_factory=dict)  # cycles by why their depth was chosen
    preempted: int = 0  # times it waited for memory after it had started (engine/memory.py)

    def record_cycle(self, k: int, kept: int, source: str = "mtp", drafts: Optional[int] = None) -> None:
        """A cycle of depth k in which the row kept `kept` drafts, the first `drafts` (default
        k) made by `source`, the rest padding."""
        self.forwards += 1
        self.depths[k] = self.depths.get(k, 0) + 1
        n = k if drafts is None else drafts
        self.drafted += n
        self.accepted += min(kept, n)
        if n:
            counts = self.by_source.setdefault(source, [0, 0])
            counts[0], counts[1] = counts[0] + n, counts[1] + min(kept, n)
        if source != "suffix":  # a suffix draft's length is its match's, not a depth
            self._record_positions(n, kept)

    def _record_positions(self, k: int, kept: int) -> None:
        while len(self.drafted_by_position) < k:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
        for i in range(k):
            if kept >= i:  # position i+1 was reached
                self.drafted_by_position[i] += 1
                if kept > i:
                    self.accepted_by_position[i] += 1

    @property
    def decode_tokens(self) -> int:
        return max(0, self.generated_tokens - 1)

    def as_dict(self) -> dict:
        by_pos = [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
            "acceptance_by_position": by_pos,
            "by_source": {s: {"drafted": d, "accepted": a} for s, (d, a) in sorted(self.by_source.items())},
            # The first token comes from the prefill; a decode forward yields the rest.
            "tokens_per_forward": self.decode_tokens / self.forwards if self.forwards else 0.0,
            "forwards": self.forwards,
            "depths": dict(sorted(self.depths.items())),
            "depth_reasons": dict(self.depth_reasons),
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "time": {"draft": self.draft_seconds, "verify": self.device_seconds,
                     "overhead": self.overhead_seconds},
            "tokens_per_second": (self.decode_tokens / self.decode_seconds) if self.decode_seconds else 0.0,
        }


@dataclass
class Event:
    """Output of one engine step for one request."""

    request_id: int
    token_ids: List[int]
    text: str  # new text, stop strings never included
    finish_reason: Optional[str] = None  # "stop" | "length" | "cancelled" | "error"
    logprobs: Optional[List[dict]] = None  # per token: {"token", "logprob", "top": [(id, lp), ...]}
    stats: Optional[RequestStats] = None  # on the final event
    error: Optional[str] = None
    # The request's field whose content failed it (its `error` is then the client's: a 400), if any.
    error_param: Optional[str] = None
    stop: Optional[str] = None  # the stop string that ended the request (finish_reason "stop")
