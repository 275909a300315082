"""`MTPModel`: what `load` returns, the untouched mlx-lm model with its MTP head."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import mlx.nn as nn

from ..mlxlm.family import TextParts
from .draft_vocab import DraftVocab
from .head_source import HeadSource
from .mtp_head import MTPHead


@dataclass
class MTPModel:
    """What `load` returns: the mlx-lm model (`base`, untouched), its MTP head (None when
    MTP is off, `disabled_reason` saying why) and the depth policies the engines of this
    model learn and share. Calls, and attributes it does not have, go to `base`: mlx-lm's
    own generation functions take an MTPModel as they take the model."""

    base: nn.Module
    parts: TextParts
    head: Optional[MTPHead]
    source: Optional[HeadSource]
    info: dict
    hidden_state: str = "post_norm"
    disabled_reason: Optional[str] = None
    policies: dict = field(default_factory=dict)  # learnt depth policies, shared by engines
    vocab: Optional[DraftVocab] = None  # embedding / lm_head as the drafter uses them
    compiled_head: Optional[object] = None  # engine.compiled_head.CompiledHead, made by the first engine asking
    model_dir: Optional[Path] = None  # the folder it was loaded from (generation_config.json, ...)

    @property
    def active(self) -> bool:
        return self.head is not None

    def __call__(self, *args, **kwargs):
        return self.base(*args, **kwargs)

    def __getattr__(self, name: str):
        base = self.__dict__.get("base")
        if base is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(base, name)
