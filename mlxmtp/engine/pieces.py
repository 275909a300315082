"""What the engine runs of a loaded model, and the depth policy its engines share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx

from ..mlxlm.family import TextParts, text_parts
from ..models.mtp_head import MTPHead
from ..models.mtp_model import MTPModel
from .compiled_head import CompiledHead
from .policy.adaptive import DepthPolicy
from .proposers.mtp_head import Vocab


@dataclass(frozen=True)
class ModelPieces:
    parts: TextParts  # the main model, run through mlxlm.adapter.forward
    head: Optional[MTPHead]  # the MTP head (or its CompiledHead); None: plain decoding only
    vocab: Vocab  # what the drafter embeds and projects with (a float32 copy on the CPU for small tables)
    hidden_state: str  # which main-model hidden state feeds the head: "post_norm" or "pre_norm"
    compiled: bool = False  # the head's shape-stable steps and the accept step run as compiled graphs


def model_pieces(model, enable_mtp: bool, compile_steps: bool = False) -> ModelPieces:
    """An MTPModel (models.load) brings its head; a plain mlx-lm model runs without.
    `compile_steps`: run the head's shape-stable steps (compiled_head.py) and the accept
    step (sampling/accept.py) as compiled graphs."""
    if isinstance(model, MTPModel):
        parts, head, hidden_state, vocab = model.parts, model.head, model.hidden_state, model.vocab
    else:
        parts, head, hidden_state, vocab = text_parts(model), None, "post_norm", None
    vocab = vocab or parts
    if not enable_mtp:
        head = None
    elif head is not None and compile_steps:
        if model.compiled_head is None:  # one per model: its traces serve every engine of it
            model.compiled_head = CompiledHead(head)
        head = model.compiled_head
    return ModelPieces(parts, head, vocab, hidden_state, compile_steps)


def shared_policy(model, max_depth: int, num_draft: Optional[int], source: str = "mtp",
                  beside_suffix: bool = False) -> DepthPolicy:
    """The depth policy for these settings, shared by every engine of the model that drafts
    with its head in the same way.

    Costs and acceptance belong to the model on this machine, not to one engine: engines
    of the same model (e.g. successive `generate` calls) share what was learnt. An engine
    that does not draft with the head (MTP off) gets a policy of its own (engine/parts.py):
    its plain cycles, without the head's work, timed beside the head's drafting cycles of
    another engine, would price drafting too dear (`mlxmtp bench` and bench/decode.py run
    MTP off and adaptive depth in one process). Engines with suffix drafts beside the head
    (`beside_suffix`) keep one apart from engines with the head alone: the head drafts there
    only where the suffix has nothing, the harder text, and what it keeps there would hold
    a head-alone engine's depth down (BENCHMARKS.md, depth policy)."""
    policies = model.policies if isinstance(model, MTPModel) else None
    key = policy_key(max_depth, num_draft, source, beside_suffix)
    if policies is not None and key in policies:
        return policies[key]
    policy = DepthPolicy(max_depth=max_depth, fixed=num_draft)
    if policies is not None:
        policies[key] = policy
    return policy


def policy_key(max_depth: int, num_draft: Optional[int], source: str = "mtp", beside_suffix: bool = False) -> tuple:
    """Which of the model's shared policies (`model.policies`) engines of these settings take."""
    return (max_depth, num_draft, source, beside_suffix)


def cycle_modes(shape_stable: Optional[bool], pipeline_drafts: bool, profile: bool) -> Tuple[bool, bool]:
    """(shape_stable, pipeline_drafts) as an engine runs them.

    Shape-stable drafting cycles (see mlxlm/ragged_cache.py): what a GPU backend that plans
    or compiles kernels per shape needs. Off by default on the CPU backend, which compiles
    nothing per shape, and where attending over a whole buffer costs real work.

    Pipelined drafting cycles (cycle.launch_after) need shape-stable caches. Off by default:
    each cycle then builds the Gated DeltaNet rollback a cycle may need whether or not it
    is needed (a replay by one fused kernel on Metal, a select of recorded states
    elsewhere); on an H100 it did not beat synchronous cycles with either (BENCHMARKS.md).
    Never while profiling,
    which evaluates each cycle's drafts on their own."""
    pipeline_drafts = pipeline_drafts and not profile
    if shape_stable is None:
        shape_stable = mx.default_device() != mx.cpu
    return shape_stable or pipeline_drafts, pipeline_drafts
