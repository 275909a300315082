"""Which drafter an engine runs: the one place a new `Proposer` is chosen."""

from __future__ import annotations

import weakref
from typing import Optional

from ..pieces import ModelPieces
from .base import Proposer
from .mtp import MTPProposer


def build_proposer(pieces: ModelPieces, engine) -> Optional[Proposer]:
    """The engine's drafter, built once; None: plain decoding only (no MTP head, or MTP off).
    It asks `engine.policy` (the one in use: tests replace it) whether the engine decodes
    plainly now, through a weak reference: a drafter that held its engine would keep the
    engine, and every cache it holds, alive after its last use until a garbage collection."""
    if pieces.head is None:
        return None
    ref = weakref.ref(engine)
    return MTPProposer(pieces, lambda: ref().policy.plain_regime())
