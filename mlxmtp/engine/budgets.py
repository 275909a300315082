"""The memory an engine's caches may take: what its config gives, or, where the config
leaves it to the machine (None), the defaults for the model's weights on this device."""

from __future__ import annotations

from dataclasses import replace

from mlx.utils import tree_flatten

from ..models.mtp_model import MTPModel
from . import memory
from .config import EngineConfig
from .prefix import cache as prefix_cache


def weights(model) -> list:
    """The model's parameters and its MTP head's (which `model.parameters()` leaves out)."""
    arrays = [model.parameters()]
    if isinstance(model, MTPModel) and model.head is not None:
        arrays.append(model.head.parameters())
    return arrays


def weight_bytes(model) -> int:
    return sum(a.nbytes for _, a in tree_flatten(weights(model)))


def resolved(model, config: EngineConfig) -> EngineConfig:
    """`config` with its budgets in bytes: the prefix cache's (prefix_cache.default_budget)
    and the caches' memory (memory.default_budget) where it leaves them to the machine."""
    if config.prefix_cache_bytes is not None and config.memory_bytes is not None:
        return config
    held = weight_bytes(model)
    return replace(config,
                   prefix_cache_bytes=(prefix_cache.default_budget(held) if config.prefix_cache_bytes is None
                                       else config.prefix_cache_bytes),
                   memory_bytes=memory.default_budget(held) if config.memory_bytes is None else config.memory_bytes)
