"""Which drafter an engine runs: the one place a new `Proposer` is chosen."""

from __future__ import annotations

import weakref
from typing import Optional

from ..limits import MAX_SUFFIX_DEPTH
from ..pieces import ModelPieces
from .base import Proposer
from .hybrid import HybridProposer
from .mtp import MTPProposer
from .suffix import SuffixProposer
from .views import PromptViews


def build_proposer(pieces: ModelPieces, engine) -> Optional[Proposer]:
    """The engine's drafter, built once, by `engine.config.draft_source`: "suffix", the
    model-free suffix drafter (any model); "mtp", the MTP head; None: plain decoding only
    (no MTP head, or MTP off); with `suffix_drafts`, the head and the suffix drafter
    together (hybrid.py; on the ranks of a distributed run too: every rank's index holds
    the same tokens, and rank 0's estimates plan the cycle, distributed/shared_policy.py).
    The head's proposer asks `engine.policy` (the one
    in use: tests replace it) whether the engine decodes plainly now, through a weak
    reference: a drafter that held its engine would keep the engine, and every cache it
    holds, alive after its last use until a garbage collection."""
    def suffix() -> SuffixProposer:
        tok = engine.tokenizer
        return SuffixProposer(pieces.parts.args.vocab_size, share=engine.config.suffix_share,
                              views=PromptViews(tok) if tok is not None else None)

    if engine.config.draft_source == "suffix":
        return suffix()
    if pieces.head is None:
        return None
    ref = weakref.ref(engine)
    head = MTPProposer(pieces, lambda: ref().policy.plain_regime())
    if not engine.config.suffix_drafts:
        return head
    return HybridProposer(head, suffix(), MAX_SUFFIX_DEPTH, lambda: ref().shape_stable)
