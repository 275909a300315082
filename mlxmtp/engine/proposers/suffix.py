"""Suffix drafting as a `Proposer` (issue 44): drafts read off the text itself, no model.

Each row's drafts are what its prompt, its output so far and the engine's recent outputs
say follows its last tokens (suffix_index.SuffixDrafter: the longest match of the output's
suffix, its most frequent continuation; around a loop, on past the text's end:
`around_the_loop`). A row with no match, or a shorter one than the cycle's depth, is padded
by repeating its last token: every draft is verified, so padding costs acceptance only,
never the text.

Model-free, so q is a point mass on each draft (base.point_mass; why rejection sampling
stays exact with it is in base.py), built only when a row samples. The drafts need the
emitted tokens on the host: `pipelines` stays False, and the engine then runs drafting
cycles unpipelined whatever `pipeline_drafts` says.

State, per request id: its drafter and how many of its row's tokens (prompt + output) the
drafter holds. A row's tokens are indexed as they are emitted (`after_verify`), and again
before each proposal from the row itself, which also covers a row that was sent back to
wait and resumed. A request that left the batch hands its output (never its prompt) to the
shared index of recent outputs and its state is dropped.

An agent copies what it read, but not always as it read it (JSON-escaped into a tool
call's arguments; without the line numbers its Read tool showed; behind a patch's marks):
views.py renders the prompt those ways, and the drafter indexes the renderings beside the
prompt, a patch's once the row's output starts one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional

import mlx.core as mx

from ..suffix_index import Draft, SharedOutputs, SuffixDrafter
from .base import Drafts, Picker, Proposer, point_mass
from .views import PromptViews

SHARED_TOKENS = 1 << 18  # recent outputs kept for every request to draft from (16 bytes a token)
PATCH_OVERLAP = 8  # tokens before a row's new ones looked at again for a patch's mark (and the line end before it)
_REMEMBERED = 4096  # requests whose share of the shared index is remembered (drop_absent)


def around_the_loop(draft: Draft, tokens: List[int], max_len: int) -> Draft:
    """`draft` carried on around a loop. In text that repeats itself every P tokens (a line
    written again and again, a model's loop) the longest match is the previous period, whose
    continuation ends where the text does: P tokens, the text's last P again. Where the
    draft is exactly those and they came twice before it, the draft goes on repeating them,
    up to max_len and the match's length (the index's own bound), each at the last one's
    chance. Verified like any draft: a loop that breaks costs acceptance only."""
    P, limit = len(draft.tokens), min(max_len, draft.match_len)
    if not 0 < P < limit or len(tokens) < 2 * P or draft.tokens != tokens[-P:] or tokens[-2 * P:-P] != tokens[-P:]:
        return draft
    more = limit - P
    return Draft(draft.tokens + [draft.tokens[i % P] for i in range(more)], draft.probs + [draft.probs[-1]] * more,
                 draft.match_len)


def padded(draft: List[int], row, k: int) -> List[int]:
    """`draft` made k tokens long by repeating its last token (the row's last one if it has
    none): every draft is verified, so padding costs acceptance only, never the text."""
    return draft + [draft[-1] if draft else row.tokens[-1]] * (k - len(draft))


class _RowState:
    """One request's drafter, how many of its row's tokens it has indexed, and whether its
    output has started a patch (views.PromptViews.for_patch indexed)."""

    def __init__(self, prompt: List[int], shared: Optional[SharedOutputs], views: List[List[int]]):
        self.drafter = SuffixDrafter(prompt, shared, views=views)
        self.held = len(prompt)
        self.patching = False


class SuffixProposer(Proposer):
    pipelines = False  # drafts from the emitted tokens, read on the host
    source = "suffix"

    def __init__(self, vocab_size: int, share: bool = True, shared_tokens: int = SHARED_TOKENS,
                 views: Optional[PromptViews] = None):
        self.vocab_size = vocab_size
        self.views = views  # other renderings of each prompt to draft from
        self.shared = self.shared_index = SharedOutputs(shared_tokens) if share else None
        self.states: Dict[int, _RowState] = {}
        # Request id -> output tokens it has added to the shared index, for the latest requests.
        self._shared_upto: "OrderedDict[int, int]" = OrderedDict()

    def proposal(self, row, max_len: int) -> Draft:
        """What the row's tokens so far say comes next (at most max_len tokens, with the
        estimated chance that each prefix is kept: suffix_index.Draft)."""
        draft = self._sync(row).drafter.propose(max_len=max_len)
        return around_the_loop(draft, list(row.tokens[-2 * len(draft.tokens):]), max_len) if draft.tokens else draft

    def propose(self, batch, rows: List, k: int, pick: Picker) -> Drafts:
        out = []
        for row in rows:
            draft = self.proposal(row, k).tokens[:k]
            out.append(padded(draft, row, k))
        tokens = mx.array(out, dtype=mx.int32)
        sampled = any(not r.sampler.params.greedy for r in rows)
        return Drafts(tokens, point_mass(tokens, self.vocab_size) if sampled else None)

    def after_verify(self, batch, cycle, tokens: List[List[int]], consumed: List[int]) -> None:
        for row in cycle.rows:  # emit_cycle has appended the cycle's tokens to row.tokens
            if row.req.id in self.states:
                self._sync(row)

    def _sync(self, row) -> _RowState:
        """The row's state, holding every token the row has (built on its first proposal)."""
        state = self.states.get(row.req.id)
        if state is None:
            prompt = list(row.req.prompt)
            state = self.states[row.req.id] = _RowState(prompt, self.shared, self.views.first(prompt) if self.views else [])
        if len(row.tokens) > state.held:
            state.drafter.extend(row.tokens[state.held:])
            self._watch_for_patch(state, row)
            state.held = len(row.tokens)
        return state

    def _watch_for_patch(self, state: _RowState, row) -> None:
        """Indexes the patch views once the row's output (its new tokens and the few before
        them, where a mark may have begun) starts a patch."""
        if self.views is None or state.patching:
            return
        escaped = self.views.patch_start(row.tokens[max(len(row.req.prompt), state.held - PATCH_OVERLAP):])
        if escaped is not None:
            state.drafter.add_views(self.views.for_patch(list(row.req.prompt), escaped))
            state.patching = True

    def drop_absent(self, present: set) -> None:
        """Requests no longer in the batch: their outputs go to the shared index (the engine
        calls this as rows leave). A request sent back to wait for memory (engine/memory.py)
        leaves and comes back: what it adds when it leaves again is only what it wrote since
        (`_shared_upto`)."""
        for rid in [rid for rid in self.states if rid not in present]:
            output = self.states.pop(rid).drafter.output()
            start = self._shared_upto.pop(rid, 0)
            if self.shared is not None and len(output) > start:
                self.shared.add(output[start:])
            self._shared_upto[rid] = len(output)
            while len(self._shared_upto) > _REMEMBERED:
                self._shared_upto.popitem(last=False)
