"""Where a model's MTP head is and reading its weights: mlxmtp's own `mtp/` folder, or
`mtp.*` tensors in the HF checkpoint's shards or a sidecar file (checkpoint/ reads both
formats)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx

from ..checkpoint import hf_head, mtp_folder
from ..checkpoint.norm_convention import NormReference
from . import head_layouts
from .errors import MTPLoadError

HEAD_CONFIG_KEYS = ("expert_layout", "num_experts", "num_layers", "moe")  # the layout an mtp/config.json gives


@dataclass
class HeadSource:
    location: str  # "hf_checkpoint" | "mtp_folder"
    path: Path
    tensors: Dict[str, str] = field(default_factory=dict)  # hf: tensor -> shard
    config: Optional[dict] = None  # mtp_folder: mtp/config.json


def locate_head(model_dir: Path) -> Optional[HeadSource]:
    """Where the head's weights are, judged by the tensors present, never by the config
    (fine-tunes and most quantized conversions keep `mtp_num_hidden_layers` and drop the
    tensors): mlxmtp's own `mtp/` folder, else `mtp.*` tensors in the shards or a sidecar
    (a `mtp/` folder another tool wrote holds those)."""
    model_dir = Path(model_dir)
    problem = None
    if mtp_folder.has_mtp_folder(model_dir):
        folder = model_dir / mtp_folder.FOLDER
        try:
            config = json.loads((folder / mtp_folder.CONFIG).read_text())
            problem = mtp_folder.config_problem(config, HEAD_CONFIG_KEYS)
        except (OSError, ValueError) as e:
            problem = f"its {mtp_folder.CONFIG}: {e}"
        if problem is None:
            return HeadSource("mtp_folder", folder, config=config)
    try:
        files = hf_head.mtp_tensor_files(model_dir)
    except (OSError, ValueError) as e:  # a sidecar file whose header does not parse
        raise MTPLoadError(_unreadable_head(model_dir, str(e))) from e
    if files:
        return HeadSource("hf_checkpoint", model_dir, tensors=files)
    if problem is not None:
        raise MTPLoadError(_unreadable_head(model_dir, problem))
    return None


def _unreadable_head(model_dir: Path, why: str) -> str:
    return (f"the MTP head in {model_dir} cannot be read ({why}). Rebuild it with: mlxmtp add-mtp-weights "
            f"--model {model_dir} --source <BF16 HF checkpoint or repo id> --force")


def read_head(model_dir: Path, reference_norms: NormReference) -> Optional[tuple]:
    """(HeadSource, head_weights(...)) of the model's head, None when it has none; a head
    whose files cannot be read (cut short, another format) is an MTPLoadError."""
    source = locate_head(model_dir)
    if source is None:
        return None
    try:
        return source, head_weights(source, reference_norms)
    except (OSError, ValueError, RuntimeError, KeyError) as e:  # RuntimeError: MLX's safetensors reader
        raise MTPLoadError(_unreadable_head(model_dir, str(e))) from e


def head_weights(source: HeadSource, reference_norms: NormReference) -> tuple[Dict[str, mx.array], dict, Optional[dict]]:
    """(parameters in MTPHead naming, layout info, quantization) for a located head;
    `mtp.*` tensors' norms are shifted unless they were already (head_layouts.py: judged
    against `reference_norms`, the model's own)."""
    if source.location == "mtp_folder":
        config, weights = mtp_folder.read_mtp_folder(source.path.parent)
        info = {k: config[k] for k in HEAD_CONFIG_KEYS}
        return weights, info, config.get("quantization")
    tensors = hf_head.load_mtp_tensors(source.path, source.tensors)
    weights, info = head_layouts.convert_settling_norms(tensors, reference_norms)
    return weights, info, None
