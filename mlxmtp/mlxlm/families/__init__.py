"""The supported model families, one file each: its `Family` (its layer classes in mlx-lm,
what mlxmtp patches in them, its Hugging Face tensor conventions).

Adding a family: its file here, its line in FAMILIES below (the patches then cover its
modules, and family.check_patched holds them to it) and its fixtures (mlxmtp/testing).
"""

from __future__ import annotations

from typing import Dict

from . import qwen3_5, qwen3_5_moe, qwen3_next
from .base import PATCHED, Family

FAMILIES: Dict[str, Family] = {f.model_type: f for f in (qwen3_next.FAMILY, qwen3_5.FAMILY, qwen3_5_moe.FAMILY)}
SUPPORTED = tuple(FAMILIES)

__all__ = ["FAMILIES", "PATCHED", "SUPPORTED", "Family"]
