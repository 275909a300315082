"""The engine's parts, built in one place: what `BatchGenerator` runs with, every part
made once and handed what it needs (no part sets another's fields later).

Where the engine runs in lockstep with other ranks (engine/coordinator.py), the parts get
the coordinator's answers here: the depth policy it wraps, and its size agreement for the
prefix cache and the memory guard. A new engine option is a field of EngineConfig read
here (or by the engine, from `settings`); a new drafter is a part built here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from ..mlxlm import adapter
from . import budgets, memory
from .config import EngineConfig
from .coordinator import Coordinator
from .pieces import ModelPieces, model_pieces, shared_policy
from .policy import saved
from .policy.adaptive import DepthPolicy
from .policy.base import Policy
from .prefix import disk as prefix_disk
from .prefix.cache import PrefixCache


@dataclass(frozen=True)
class EngineParts:
    settings: EngineConfig  # the config with its budgets in bytes (engine/budgets.py)
    coordinator: Coordinator
    pieces: ModelPieces  # what runs of the model (engine/pieces.py)
    policy: Policy  # the depth policy, as the coordinator gives it
    prefix_cache: PrefixCache
    memory: memory.MemoryGuard
    saved: Union[saved.SavedPolicy, saved.NotKept] = saved.NotKept()  # the depth policy's file across runs


def make_parts(model, config: EngineConfig, coordinator: Optional[Coordinator] = None) -> EngineParts:
    """The parts of an engine of `model` built from `config`; `coordinator`: None for a
    process alone. On a distributed rank the size agreements below are collectives, made in
    this order on every rank."""
    config.validate()
    coordinator = coordinator or Coordinator()
    c = budgets.resolved(model, config)
    # compile_steps: off by default, to be measured on a GPU (engine/compiled_head.py). The
    # suffix drafter leaves the head out: no head caches, passes or memory for it.
    pieces = model_pieces(model, c.enable_mtp and c.draft_source == "mtp", c.compile_steps)
    policy = coordinator.policy(shared_policy(model, c.max_depth, c.num_draft, c.draft_source, c.suffix_drafts)
                                if pieces.head is not None else DepthPolicy(c.max_depth, fixed=c.num_draft))
    adapter.prepare_model(pieces.parts.text_model)
    agree = coordinator.agreement()
    # Every rank keeps and evicts the same entries, so all use rank 0's budget (each rank's
    # own default is a share of its own machine's memory).
    cache_bytes = agree(c.prefix_cache_bytes) if agree is not None else c.prefix_cache_bytes
    # memory_bytes: what running rows and the prefix cache may hold together (0: unbounded);
    # every rank admits and pauses the same rows, so all use rank 0's sizes and budget.
    footprint, room = memory.sizes(pieces, c.memory_bytes, agree)
    disk = None
    if c.prefix_cache_dir:  # the prefix cache's disk tier (engine/prefix/disk.py)
        disk = prefix_disk.store_for(pieces, model, Path(c.prefix_cache_dir), c.prefix_cache_disk_mb << 20,
                                     cache_bytes, coordinator.lockstep)
    prefix_cache = PrefixCache(cache_bytes, c.prefix_cache_entries, agree=agree,
                               room=room.left if room.budget > 0 else None, disk=disk)
    guard = memory.MemoryGuard(footprint, room, prefix_cache)
    return EngineParts(c, coordinator, pieces, policy, prefix_cache, guard, saved.for_engine(model, pieces, c))
