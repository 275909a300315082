"""The default model: the small trained demo model shipped in the package
(`mlxmtp/demo_model/`, built by scripts/train_demo_model.py)."""

from __future__ import annotations

from pathlib import Path

PACKAGED = Path(__file__).resolve().parent.parent / "demo_model"


def demo_model_path() -> Path:
    if not (PACKAGED / "config.json").exists():
        raise FileNotFoundError(
            f"the demo model is missing from {PACKAGED}: this mlxmtp installation is incomplete "
            "(reinstall it, or pass a model path)"
        )
    return PACKAGED
