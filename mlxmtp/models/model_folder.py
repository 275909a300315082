"""Where a model's folder is (here, the demo's, or fetched from the Hub) and whether it is
one mlx-lm can load."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from . import demo
from .errors import ModelLoadError
from .hub import CONFIG_FILES, hub_snapshot


def resolve_model_path(path_or_hf_id: str, revision: Optional[str] = None,
                       weight_files: Optional[list] = None) -> Path:
    """A local folder as is, the demo's by its name `mlxmtp-demo`; otherwise a Hugging Face
    repo id through huggingface_hub (its cache makes a second load offline). `weight_files`:
    fetch only these weight files (a rank of a distributed run: distributed/load.py);
    default every one."""
    path_or_hf_id = demo.resolve(path_or_hf_id)
    p = Path(path_or_hf_id).expanduser()
    if p.exists():
        return p
    weights = ["*.safetensors"] if weight_files is None else list(weight_files)
    return hub_snapshot(path_or_hf_id, CONFIG_FILES + weights, revision)


def check_model_folder(model_dir: Path, weights: bool = True) -> None:
    """Refuse, in one line, a folder mlx-lm could only fail on with a traceback (`weights`:
    one that must hold the weights, not only the configs and tokenizer)."""
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir} is not a folder: give a model folder or a Hugging Face repo id")
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} is not a model folder: it has no config.json")
    if weights and not any(model_dir.glob("*.safetensors")):
        raise ModelLoadError(f"{model_dir} is not a model folder: it has no *.safetensors weights")
