"""What the engine runs of a loaded model, and the depth policy its engines share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..mlxlm.family import TextParts, text_parts
from ..models.mtp_head import MTPHead
from .adaptive import DepthPolicy
from .proposer import Vocab


@dataclass(frozen=True)
class ModelPieces:
    parts: TextParts  # the main model, run through mlxlm.adapter.forward
    head: Optional[MTPHead]  # the MTP head; None: plain decoding only
    vocab: Vocab  # what the drafter embeds and projects with (a float32 copy on the CPU for small tables)
    hidden_state: str  # which main-model hidden state feeds the head: "post_norm" or "pre_norm"


def model_pieces(model, enable_mtp: bool) -> ModelPieces:
    """A model loaded by mlxmtp carries its head in `model.mtp`; any other runs without."""
    att = getattr(model, "mtp", None)
    if att is None:
        parts, head, hidden_state = text_parts(model), None, "post_norm"
    else:
        parts, head, hidden_state = att.parts, att.head, att.hidden_state
    vocab = getattr(att, "vocab", None) or parts
    return ModelPieces(parts, head if enable_mtp else None, vocab, hidden_state)


def shared_policy(model, max_depth: int, num_draft: Optional[int]) -> DepthPolicy:
    """The depth policy for these settings, shared by every engine of the model.

    Costs and acceptance belong to the model on this machine, not to one engine: engines
    of the same model (e.g. successive `generate` calls) share what was learnt."""
    policies = getattr(getattr(model, "mtp", None), "policies", None)
    key = (max_depth, num_draft)
    if policies is not None and key in policies:
        return policies[key]
    policy = DepthPolicy(max_depth=max_depth, fixed=num_draft)
    if policies is not None:
        policies[key] = policy
    return policy
