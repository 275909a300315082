"""The `mtp/` folder: an MTP head injected into an MLX model folder.

Layout (format_version 1):
    MODEL_DIR/mtp/config.json         small JSON, see `make_head_config`
    MODEL_DIR/mtp/weights.safetensors MTPHead parameters in mlx naming
                                      (`fc.weight`, `layers.0.mlp.switch_mlp...`),
                                      norms already shifted (+1 applied once),
                                      quantized per config["quantization"].

It lives in a subfolder, never in `model*.safetensors`: stock mlx-lm loads every
top-level `*.safetensors` file, and `mtp.*` keys there break its strict load
(Qwen3-Next) or get their norms shifted again (older Qwen3.5 sanitize).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx

FOLDER = "mtp"
CONFIG = "config.json"
WEIGHTS = "weights.safetensors"
FORMAT = "mlxmtp-mtp-head"
FORMAT_VERSION = 1


class MTPFolderError(ValueError):
    pass


def make_head_config(
    *,
    source: str,
    family: str,
    info: dict,
    quantization: Optional[dict],
    dtype: str,
    hidden_state: str = "post_norm",
) -> dict:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "source": source,  # the checkpoint the head was taken from
        "family": family,
        "num_layers": info["num_layers"],
        "expert_layout": info["expert_layout"],  # layout in the source: dense/per_expert/fused
        "num_experts": info["num_experts"],
        "moe": info["moe"],
        "norms_shifted": True,  # mlx convention: +1 already applied, never apply again
        "quantization": quantization,  # mlx-lm style dict, None for unquantized
        "dtype": dtype,
        "hidden_state": hidden_state,
    }


def has_mtp_folder(model_dir: Path) -> bool:
    return (Path(model_dir) / FOLDER / CONFIG).exists() and (Path(model_dir) / FOLDER / WEIGHTS).exists()


def read_mtp_folder(model_dir: Path) -> Tuple[dict, Dict[str, mx.array]]:
    folder = Path(model_dir) / FOLDER
    config = json.loads((folder / CONFIG).read_text())
    if config.get("format") != FORMAT or config.get("format_version") != FORMAT_VERSION:
        raise MTPFolderError(f"{folder} is not an mlxmtp head folder of format version {FORMAT_VERSION}")
    if config.get("norms_shifted") is not True:
        raise MTPFolderError(
            f"{folder / CONFIG} does not record norms_shifted=true; refusing to guess the norm convention"
        )
    return config, mx.load(str(folder / WEIGHTS))


def write_mtp_folder(model_dir: Path, config: dict, weights: Dict[str, mx.array], *, force: bool = False) -> Path:
    """Write `mtp/` atomically: a temporary sibling folder, then one rename.

    A crash at any point leaves either no `mtp/` (or the previous one) or a complete one.
    """
    model_dir = Path(model_dir)
    final = model_dir / FOLDER
    if final.exists() and not force:
        raise MTPFolderError(f"{final} already exists (use --force to replace it)")
    tmp = Path(tempfile.mkdtemp(prefix=".mtp-tmp-", dir=model_dir))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the model folder's readers need it too
    try:
        mx.save_safetensors(str(tmp / WEIGHTS), weights, metadata={"format": "mlx"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        for f in tmp.iterdir():  # data on disk before the rename makes it visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        old = None
        if final.exists():
            old = model_dir / f".mtp-old-{os.getpid()}"
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
