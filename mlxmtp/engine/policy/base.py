"""The interface between the engine and a draft-depth policy.

The engine asks `choose` for each cycle's depth (0 = plain decoding), reports every cycle
through `update`, and, when `needs_costs` says so, calibrates cycle costs for a batch
size, greedy and sampled, and hands them to `seed_costs` (engine/policy/calibration.py).
`adaptive.DepthPolicy` is the policy the engine uses; tests script others on this base.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple

# The acceptance classes of rows (engine/state.acceptance_classes): greedy, sampled, and
# sampled reproducibly (engine/sampling/seeded.py); the first two are also the kinds of batch a
# policy prices apart (`cost_kind`).
GREEDY, SAMPLED, REPRODUCIBLE = "greedy", "sampled", "reproducible"
COST_KINDS = (GREEDY, SAMPLED)  # the kinds of batches a cost table is kept for (cost_kind)


# The first OPENING_TOKENS tokens of a row's answer are learnt apart from the rest, in two
# classes (`Opening`, split at OPENING_SPLIT): a head can keep far fewer drafts early in an answer
# than further on (the demo's, by position: BENCHMARKS.md, the H100's cycle costs on this CPU),
# and a policy learns acceptance where it drafts, which is mostly where requests start (its
# calibration, probes): learnt together, the start of every answer would price its rest. A
# request's own first drafts come past its opening (requests.py), where most of its answer is.
OPENING_SPLIT, OPENING_TOKENS = 16, 48


class Opening(NamedTuple):
    """The acceptance class of a row of this kind within its answer's first OPENING_TOKENS: its
    first OPENING_SPLIT (`part` 0) or the rest of them (1)."""

    kind: Hashable
    part: int = 0


def row_class(kind: Hashable, generated: int) -> Hashable:
    """The acceptance class of a row of this kind with `generated` answer tokens."""
    return Opening(kind, int(generated >= OPENING_SPLIT)) if generated < OPENING_TOKENS else kind


def kind_of(cls: Hashable) -> Hashable:
    """The kind (GREEDY, SAMPLED, REPRODUCIBLE) of an acceptance class."""
    return cls.kind if isinstance(cls, Opening) else cls


def cost_kind(classes: Optional[Sequence[Hashable]]) -> str:
    """SAMPLED if any row of the batch samples, else GREEDY: a cycle's cost depends on it
    (a sampled row's draft and accept steps make and compare whole distributions)."""
    kinds = {kind_of(cls) for cls in classes or ()}
    return SAMPLED if SAMPLED in kinds or REPRODUCIBLE in kinds else GREEDY


def bucket(batch_size: int) -> int:
    b = 1
    while b < batch_size:
        b *= 2
    return b


def cost_key(batch_size: int, classes: Optional[Sequence[Hashable]] = None) -> Tuple[int, str]:
    """Which cost table prices a cycle: (batch-size bucket, the batch's kind). A batch with a
    sampled row runs the sampled draft and accept steps (per-row distributions, random
    draws, rejection sampling), more work per cycle than the argmax a greedy batch needs."""
    return bucket(batch_size), cost_kind(classes)


class Policy:
    max_depth: int = 0  # the deepest cycle the policy may choose (and a request may pin)
    why: str = ""  # why the last choice was made (request stats, /metrics)

    def choose(self, batch_size: int, limit: Optional[int] = None,
               classes: Optional[Sequence[Hashable]] = None, requests: Optional[Sequence[Hashable]] = None) -> int:
        """The next cycle's depth for `batch_size` rows; `limit`: the most drafts worth
        making (room left to the row with the most); `classes`, `requests`: each row's
        acceptance class and request id."""
        raise NotImplementedError

    def update(self, k: int, batch_size: int, seconds: Optional[float], kept_per_row: List[int],
               classes: Optional[Sequence[Hashable]] = None, switch_seconds: Optional[float] = None,
               head: bool = True, requests: Optional[Sequence[Hashable]] = None,
               chances: Optional[List[List[float]]] = None) -> None:
        """One cycle was read: its depth, its wall time (None: not timed), the drafts each
        row kept, for the first drafting cycle after plain decoding its wall time, whether
        its drafts were the head's (a cycle of model-free drafts teaches its cost only), and
        per row each draft's chance of being kept once reached (sampling/accept.keep_chances;
        None: the drafts kept are the outcomes)."""

    def learn_head_rows(self, j: int, kept_per_row: List[int], classes: Sequence[Hashable],
                        requests: Optional[Sequence[Hashable]] = None,
                        chances: Optional[List[List[float]]] = None) -> None:
        """The rows of a cycle of suffix drafts (`update` with head=False) that drafted with the
        head, at depth j: what each kept of the head's drafts, as `update` reports a head cycle's."""

    def request_started(self, cls: Hashable, request: Hashable = None) -> None:
        """A request (id `request`) of acceptance class `cls` has its first decode cycle next."""

    def plain_regime(self) -> bool:
        """Whether plain decoding is the depth in use outside probes (the engine then keeps
        the head's pending inputs bounded instead of feeding them to the head)."""
        return False

    def needs_costs(self, batch_size: int) -> bool:
        """Whether the engine should calibrate cycle costs at this batch size now (once no
        for a batch size, no for good: a distributed engine asks rank 0 only until then)."""
        return False

    def expected_tokens(self, optimistic: bool = False, classes: Sequence[Hashable] = (None,)) -> Optional[List[float]]:
        """E(k) per row for k = 0..max_depth: the tokens a cycle of depth k yields (None:
        no estimate; proposers/hybrid_plan.py then assumes one)."""
        return None

    def relative_costs(self, batch_size: int, classes: Optional[Sequence[Hashable]],
                       depths: Sequence[int], cautious: bool = False) -> Optional[Dict[int, float]]:
        """The cost of a cycle of each of `depths` relative to a plain one, where known (None:
        nothing measured); depths past those measured priced by their trend, and never less
        than a shallower depth. `cautious`: each drafting depth's raised by the policy's doubt
        about it (a choice among noisy costs picks one that came out low), except that a depth
        beyond the deepest one measured costs halfway between that one's cost and the trend's
        (CycleCosts.relative): a trend from a few short depths, noisy, can price a long verify
        out of ever being tried, and so measured."""
        return None

    def seed_costs(self, batch_size: int, seconds: Dict[int, float], kind: str = GREEDY) -> None:
        """Calibrated seconds per cycle of each depth at this batch size, for batches of
        this kind (`cost_kind`)."""
