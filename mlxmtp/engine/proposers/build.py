"""Which drafter an engine runs: the one place a new `Proposer` is chosen."""

from __future__ import annotations

import weakref
from typing import Optional

from ..pieces import ModelPieces
from .base import Proposer
from .mtp import MTPProposer
from .suffix import SuffixProposer


def build_proposer(pieces: ModelPieces, engine) -> Optional[Proposer]:
    """The engine's drafter, built once, by `engine.config.draft_source`: "suffix", the
    model-free suffix drafter (any model); "mtp", the MTP head; None: plain decoding only
    (no MTP head, or MTP off). The head's proposer asks `engine.policy` (the one in use:
    tests replace it) whether the engine decodes plainly now, through a weak reference: a
    drafter that held its engine would keep the engine, and every cache it holds, alive
    after its last use until a garbage collection."""
    if engine.config.draft_source == "suffix":
        return SuffixProposer(pieces.parts.args.vocab_size)
    if pieces.head is None:
        return None
    ref = weakref.ref(engine)
    return MTPProposer(pieces, lambda: ref().policy.plain_regime())
