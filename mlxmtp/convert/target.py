"""The model folder being repaired, as the converter sees it: loaded lazily on the CPU."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import mlx.core as mx

from ..mlxlm.family import text_parts
from ..mlxlm.loading import load_model
from ..models.mtp_head import MTPHead


@contextlib.contextmanager
def cpu() -> Iterator[None]:
    """Run on the CPU (a GPU may not take 512 experts at once), restoring the default after."""
    prev = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        with mx.stream(mx.cpu):
            yield
    finally:
        mx.set_default_device(prev)


def load_target(model_dir: Path):
    """The target model, lazily (nothing but headers read), to compare shapes against."""
    with cpu():
        model, _ = load_model(Path(model_dir), lazy=True)
    return model


def head_skeleton(target, info: dict) -> MTPHead:
    """An MTPHead for the target, of the source head's shape (lazy: no weights)."""
    with cpu():
        return MTPHead(text_parts(target), num_layers=max(1, info["num_layers"]), moe=info["moe"])
