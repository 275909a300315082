"""Was a head's +1 norm shift applied exactly once? Judged against the model's own norms.

HF checkpoints store Qwen's RMSNorm weights zero-centred (effective weight 1 + w); mlx-lm
adds the 1 to the main model's norms once, and the head's need the same. A head shifted
twice, never, or only in part (mixed conventions give 0% acceptance: mtp-reference.md)
shows as norms sitting ~1 above or below the model's norms of the same kind. Each head norm
is compared with the span of the model's norms of its kind (its decoder layers'
`input_layernorm`s for the head's, the final norm for `mtp.norm`), not with one norm: a
trained head's norms drift as far from the final norm as a misshift would (the demo's
`post_attention_layernorm`: 0.87 against a final norm of 1.48, in line with the model's own
post-attention norms, 0.75-1.09).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

# A head norm whose effective mean sits this far outside the span of the model's norms of
# its kind, and within NEAR_ONE of exactly 1 outside it, had its +1 applied twice (above)
# or never (below).
MIN_OFFSET = 0.6
NEAR_ONE = 0.4
# The decoder-layer norms a head layer shares with the model's layers, by name ending.
LAYER_NORM_KINDS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")
FINAL = "norm.weight"


@dataclass(frozen=True)
class NormReference:
    """(lowest, highest) mean effective weight of the model's norms, by kind (FINAL or a
    LAYER_NORM_KINDS ending). A head norm with no kind of its own (the pre-fc norms) is
    judged against the span of them all."""

    spans: Dict[str, Tuple[float, float]]

    def span(self, name: str) -> Tuple[float, float]:
        kind = norm_kind(name)
        if kind in self.spans:
            return self.spans[kind]
        return min(lo for lo, _ in self.spans.values()), max(hi for _, hi in self.spans.values())

    def offset(self, name: str, mean: float) -> float:
        """How far `mean` sits above (+) or below (-) the span of the norms of `name`'s kind."""
        lo, hi = self.span(name)
        return mean - hi if mean > hi else mean - lo if mean < lo else 0.0


def norm_reference(backbone) -> NormReference:
    """The NormReference of an mlx-lm backbone (its norms are shifted already)."""
    means: Dict[str, list] = {}
    for name, w in tree_flatten(backbone.parameters()):
        kind = norm_kind(name)
        if kind is not None and w.ndim == 1:
            means.setdefault(kind, []).append(mean_weight(w))
    return NormReference({kind: (min(v), max(v)) for kind, v in means.items()})


def norm_kind(name: str):
    """FINAL, the LAYER_NORM_KINDS ending of `name` (with or without `mtp.`), or None."""
    name = name.removeprefix("mtp.")
    return FINAL if name == FINAL else next((k for k in LAYER_NORM_KINDS if name.endswith(k)), None)


def mean_weight(w: mx.array) -> float:
    return w.astype(mx.float32).mean().item()


@dataclass(frozen=True)
class MisshiftedNorm:
    name: str
    twice: bool  # True: ~1 above the model's norms (+1 applied twice); False: ~1 below (never)
    mean: float  # mean effective weight of the head's norm
    span: Tuple[float, float]  # the span of the model's norms of its kind


def misshifted_norms(norms: Iterable[Tuple[str, mx.array]], reference: NormReference) -> Iterator[MisshiftedNorm]:
    """The head norms (name, effective weight: after the +1) whose +1 shift was applied
    twice or never."""
    for name, w in norms:
        mean = mean_weight(w)
        off = reference.offset(name, mean)
        if abs(off) > MIN_OFFSET and abs(abs(off) - 1.0) < NEAR_ONE:
            yield MisshiftedNorm(name, off > 0, mean, reference.span(name))


def shifted_already(norms: Dict[str, mx.array], reference: NormReference) -> bool:
    """Whether head norms given a +1 (effective weights `norms`) sit nearer the model's
    norms without it: the head was stored shifted already."""
    means = {name: mean_weight(w) for name, w in norms.items()}
    unshifted = sum(abs(reference.offset(n, m - 1.0)) for n, m in means.items())
    return bool(means) and unshifted < sum(abs(reference.offset(n, m)) for n, m in means.items())
