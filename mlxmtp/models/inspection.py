"""What `mlxmtp inspect` prints about a model: its family, quantization and MTP head, read
from the configs and safetensors headers only (nothing is loaded)."""

from __future__ import annotations

import json
from typing import Optional

from ..checkpoint import hf_head, tensor_files
from ..mlxlm.family import family_of, text_config
from .errors import ModelLoadError
from .head_source import HeadSource, locate_head
from .model_folder import check_model_folder, resolve_model_path


def inspect_model(path_or_hf_id: str) -> dict:
    """What `mlxmtp inspect` prints; reads configs and safetensors headers only."""
    model_dir = resolve_model_path(path_or_hf_id)
    check_model_folder(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {e}") from e
    family = family_of(config)
    tcfg = text_config(config)
    quant = config.get("quantization")
    source = locate_head(model_dir)
    return {
        "path": str(model_dir),
        "family": family,
        "quantization": None if quant is None else {k: quant[k] for k in ("bits", "group_size", "mode") if k in quant},
        "dtype": tcfg.get("torch_dtype") or config.get("torch_dtype") or tcfg.get("dtype") or config.get("dtype"),
        "hidden_size": tcfg.get("hidden_size"),
        "num_hidden_layers": tcfg.get("num_hidden_layers"),
        "vocab_size": tcfg.get("vocab_size"),
        "num_experts": tcfg.get("num_experts", 0),
        "mtp": _head_summary(source, tcfg),
    }


def _head_summary(source: Optional[HeadSource], tcfg: dict) -> dict:
    """The `mtp` entry: where the head is and its layout, as its own files say."""
    mtp: dict = {"present": source is not None}
    if source is None:
        mtp.update(layers=0, location=None, expert_layout=None, hidden_state=None,
                   config_layers=tcfg.get("mtp_num_hidden_layers", tcfg.get("num_nextn_predict_layers")))
    elif source.location == "mtp_folder":
        c = source.config
        mtp.update(layers=c["num_layers"], location=str(source.path), expert_layout=c["expert_layout"],
                   num_experts=c["num_experts"], hidden_state=c.get("hidden_state", "post_norm"),
                   quantization=c.get("quantization") and {k: c["quantization"][k] for k in ("bits", "group_size")
                                                           if k in c["quantization"]},
                   source=c.get("source"))
    else:
        names = list(source.tensors)
        mtp.update(layers=hf_head.num_head_layers(names), location=str(source.path) + " (mtp.* tensors)",
                   expert_layout=hf_head.expert_layout(names), num_experts=hf_head.num_experts(names)
                   or _fused_experts(source), hidden_state="post_norm",
                   shards=sorted(set(source.tensors.values())))
    return mtp


def _fused_experts(source: HeadSource) -> int:
    for name, shard in source.tensors.items():
        if name.endswith("experts.gate_up_proj"):
            header, _ = tensor_files.read_header(source.path / shard)
            return header[name]["shape"][0]
    return 0
