"""The interface every drafter implements: what a decode cycle asks of its draft source.

In the manner of vLLM's spec-decode split (its `EagleProposer` and `NgramProposer` are
called by the model runner through the same `propose`): the engine holds one `Proposer`,
built once (proposers/build.py), and the cycle code calls only these methods. A cycle:

  1. `propose(batch, rows, k, pick)` -> `Drafts`: k tokens per row, lazily on the device;
  2. the main model verifies [last token, drafts] in one forward; each row keeps some drafts
     (sampling/accept.py, with `Drafts.logprobs` as q for sampled rows);
  3. `after_verify(batch, cycle, tokens, consumed)`: the cycle's results, read on the host
     (also after a plain cycle, k = 0): what the drafter learns from them.

Pipelined drafting cycles (`pipeline_drafts`, cycle.launch_after) build the next cycle
before the previous one is read: a drafter that can draft from a cycle still on the device
sets `pipelines` and implements `propose_unread` and `settle`; one that needs the emitted
tokens on the host (a model-free drafter) leaves `pipelines` False and runs with
`pipeline_drafts` off.

A drafter's per-row state lives on the Row (as the head's pending inputs do, state.py) or
in the Batch's caches, which joins, drops and preemption already carry; a model-free one
may keep it by request id and drop ids absent from `after_verify`'s rows.

Exactness does not depend on the drafter: every draft is verified. Greedy rows keep a draft
iff it is the target's argmax. Sampled rows need q, the distribution each draft was drawn
from: the head samples from its processed logits (`pick`); a model-free drafter proposes
tokens outright, i.e. q is a point mass on the token (`point_mass`), and rejection sampling
then keeps draft x with probability min(1, p(x) / 1) = p(x) and on a rejection draws from
max(p - q, 0) normalised: p with x removed, renormalised (sampling/rejection.py) — exact.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple

import mlx.core as mx

# How a drafter with logits decides each draft (sampling/batch.py, BatchSampling.pick):
# pick(step, logits [B, V], drafts_so_far [B, step]) -> (tokens [B], q log-probs [B, V] or None).
Picker = Callable


class Drafts(NamedTuple):
    """One cycle's drafts, lazily on the device."""

    tokens: mx.array  # [B, k] int32: row b's drafts in tokens[b]
    # [B, k, V]: the log-probabilities each sampled row's drafts were drawn from (q; a greedy
    # row's are not read); None when every row is greedy.
    logprobs: Optional[mx.array]


def point_mass(tokens: mx.array, vocab_size: int) -> mx.array:
    """q for drafts proposed outright: tokens [B, k] -> log-probabilities [B, k, V], 0 at
    each draft token and -inf elsewhere (see the module docstring for why it is exact)."""
    hit = tokens[..., None] == mx.arange(vocab_size)
    return mx.where(hit, 0.0, -mx.inf).astype(mx.float32)


# Why a cycle got its depth when a drafter lengthened it past the depth policy's choice.
SUFFIX = "suffix match"


class Proposer:
    """A draft source. Subclasses implement `propose`; the rest defaults to nothing to do."""

    # Can draft on top of a cycle not read yet (propose_unread, settle).
    pipelines: bool = False
    source: str = ""  # its name in the stats and /metrics ("mtp", "suffix")
    # The index of finished requests' outputs it drafts from (suffix_index.SharedOutputs,
    # shown in /metrics), if any.
    shared_index = None

    def plan(self, rows: List, k: int, policy, limit: Optional[int]) -> int:
        """The next cycle's depth, given the depth policy's choice k for `rows`; `limit`:
        the most drafts worth making (room left to the row with the most). A drafter that
        may draft past the policy's depths (hybrid.py) decides here."""
        return k

    def why(self) -> Optional[str]:
        """Why the planned depth differs from the policy's (None: it does not)."""
        return None

    def needs_host_tokens(self) -> bool:
        """Whether the planned cycle needs every row's tokens on the host (the engine then
        reads the cycle in flight first instead of drafting on top of it)."""
        return not self.pipelines

    def drafted(self, n_rows: int, k: int) -> List[Tuple[str, int]]:
        """Per row of the cycle just proposed (of depth k): (source, drafts it made); the
        rest of its k drafts were padding (stats, /metrics)."""
        return [(self.source, k)] * n_rows

    def propose(self, batch, rows: List, k: int, pick: Picker) -> Drafts:
        """k drafts (k >= 1) for every row of `rows` (the Batch's rows, in order); `pick`
        decides each draft from a drafter's logits (unused by a model-free drafter)."""
        raise NotImplementedError

    def propose_unread(self, batch, prev, k: int, pick: Picker) -> Drafts:
        """`propose` for the rows of `prev`, a drafting cycle (cycle.Cycle) on the device, not
        read yet: its tokens, kept counts and hidden states are arrays."""
        raise NotImplementedError(f"{type(self).__name__} does not pipeline drafting cycles")

    def after_verify(self, batch, cycle, tokens: List[List[int]], consumed: List[int]) -> None:
        """A cycle read on the host: row b of cycle.rows emitted tokens[b][: consumed[b]]
        (its last token becomes the next cycle's input); cycle.k is 0 in plain decoding."""

    def drop_absent(self, present: set) -> None:
        """Rows left the batch (finished, failed, cancelled or sent back to wait for
        memory); `present`: the request ids still in it. A drafter forgets the others here."""

    def settle(self, batch, prev, kept: List[int]) -> None:
        """`prev` was built on by a `propose_unread` cycle and is now read: kept[b] drafts of
        row b were kept (settle what propose_unread deferred)."""
