"""The engine's state: one request's `Row`, and the `Batch` of rows decoded together.

A row waits in `BatchGenerator.waiting` from submission until its prompt is prefilled,
in caches of its own (B=1). Then it joins the `Batch`: row b of every batched cache
belongs to `Batch.rows[b]`. Rows join and leave only between decode cycles. A row sent
back to wait for memory (`to_resume`, engine/memory.py) drops its caches and is
prefilled again over what it had fed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, List, Optional

import mlx.core as mx

from ..mlxlm.model_cache import ModelCache
from .policy.base import GREEDY, REPRODUCIBLE, SAMPLED, row_class
from .proposers.mtp_head import Segment
from .request import Request, RequestStats
from .sampling.row import RowSampler


@dataclass
class Row:
    """One request inside the engine."""

    req: Request
    sampler: RowSampler  # its processors, filters and random key
    stop_ids: set  # token ids that end it
    tokens: List[int]  # prompt + generated: the processors' context
    prompt: List[int]  # what its prefill feeds: the request's prompt; resuming, all its tokens but the last
    stats: RequestStats
    detok: object  # the tokenizer's streaming detokenizer
    y: int = -1  # last emitted token, not yet fed to the main model
    generated: int = 0
    text: str = ""
    sent: int = 0  # characters of text already emitted
    # Pending head inputs: main-model hidden states the head has not consumed yet, and the
    # token after each (see proposers/mtp_head.py).
    pend: List[Segment] = field(default_factory=list)
    pend_t: List[int] = field(default_factory=list)
    # Prefill-only state (B=1) until the row joins the batch.
    cache: Optional[ModelCache] = None
    head_cache: Optional[ModelCache] = None
    done_prompt: int = 0  # prompt tokens already fed
    resuming: bool = False  # sent back to wait (engine/memory.py): its prefill emits no first token
    checkpoints: List[int] = field(default_factory=list)  # prefill stops at each to store its state (see prefill)
    t0: float = 0.0  # when its prefill started
    last_logits: Optional[mx.array] = None  # [V] after the prompt's last token
    first_lp: Optional[list] = None  # the first token's logprob table row (see sampling/logprobs.py)


def new_row(req: Request, tokenizer) -> Row:
    stop_ids = set(req.stop_token_ids if req.stop_token_ids is not None else tokenizer.eos_token_ids)
    return Row(req=req, sampler=RowSampler(req.params), stop_ids=stop_ids, tokens=list(req.prompt),
               prompt=req.prompt, stats=RequestStats(prompt_tokens=len(req.prompt)), detok=tokenizer.detokenizer)


def prompt_left(row: Row) -> int:
    """Prompt tokens not yet prefilled."""
    return len(row.prompt) - row.done_prompt


def to_resume(row: Row) -> Row:
    """Make an active row (its caches dropped) wait to resume: its prefill will feed every
    token it has but the last, which it then feeds in its next cycle as before."""
    row.prompt, row.resuming = row.tokens[:-1], True
    row.pend, row.pend_t = [], []
    row.done_prompt, row.checkpoints = 0, []
    row.last_logits = None
    row.stats.preempted += 1
    return row


def acceptance_classes(rows: List[Row]) -> List[Hashable]:
    # Greedy rows keep a draft only if it is the argmax; sampled rows by rejection sampling,
    # which keeps far more deep drafts; reproducible rows while drafts equal the target's
    # token under shared noise (engine/sampling/seeded.py): the depth policy learns them apart,
    # and each apart in an answer's opening (policy/base.row_class).
    return [row_class(GREEDY if r.sampler.params.greedy else REPRODUCIBLE if r.sampler.reproducible else SAMPLED,
                      r.generated) for r in rows]


class Batch:
    """The active rows, in batch order, and their batched caches (None while it is empty)."""

    def __init__(self, shape_stable: bool, head_width: int = 0):
        self.rows: List[Row] = []
        self.cache: Optional[ModelCache] = None
        self.head_cache: Optional[ModelCache] = None
        self.shape_stable = shape_stable
        # Shape-stable mode: the head passes of drafting cycles are padded to this many
        # queries (the deepest verify's width), one shape whatever each row kept.
        self.head_width = head_width

    def join(self, row: Row) -> None:
        """Append a prefilled row; its own caches become the batch's last row."""
        if self.cache is None:
            self.cache, self.head_cache = row.cache, row.head_cache
            # Verify forwards (and every head forward) in the shape-stable mode: a new
            # position or prompt length never makes a new shape; plain decoding (one token)
            # keeps mlx-lm's own attention call.
            if self.shape_stable:
                self.cache.fix_shapes(2)
                if self.head_cache is not None:
                    self.head_cache.fix_shapes(1)
        else:
            self.cache.extend_rows(row.cache)
            if self.head_cache is not None:
                self.head_cache.extend_rows(row.head_cache)
        row.cache = row.head_cache = None
        self.rows.append(row)

    def drop(self, gone: List[int]) -> Optional[List[int]]:
        """Remove the rows at indices `gone`; -> the indices kept (None if nothing changed)."""
        if not gone:
            return None
        keep = [i for i in range(len(self.rows)) if i not in set(gone)]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.head_cache = None
            return keep
        self.cache.filter_rows(keep)
        if self.head_cache is not None:
            self.head_cache.filter_rows(keep)
        return keep
