"""The composition root: every engine is built here, in a process alone and on every rank
of a distributed run (each rank with its coordinator, distributed/engine.py), from one
EngineConfig; its parts are made by engine/parts.py."""

from __future__ import annotations

from typing import Optional

from .batch import BatchGenerator
from .config import EngineConfig
from .coordinator import Coordinator
from .parts import make_parts


def build_engine(model, tokenizer, config: EngineConfig = EngineConfig(),
                 coordinator: Optional[Coordinator] = None) -> BatchGenerator:
    """The engine of `model` as `config` says; `coordinator`: its answers at the points
    where ranks must agree (engine/coordinator.py), None for a process alone."""
    return BatchGenerator(model, tokenizer, config, make_parts(model, config, coordinator))
