"""The default model: the small trained demo model shipped in the package.

Until it is built (scripts/train_demo_model.py), a tiny random fixture with a real
MTP head layout stands in, written once into the user cache.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGED = Path(__file__).resolve().parent.parent / "demo_model"


def demo_model_path() -> Path:
    if (PACKAGED / "config.json").exists():
        return PACKAGED
    cache = Path(os.environ.get("MLXMTP_CACHE", Path.home() / ".cache" / "mlxmtp")) / "fixture-demo"
    if not (cache / "config.json").exists():
        from ..testing.fixtures import write_hf_checkpoint

        write_hf_checkpoint(cache, "qwen3_5")
    return cache
