"""Turn the `mtp.*` tensors of an HF checkpoint into MTPHead parameters.

Done exactly as mlx-lm's `sanitize` treats the equivalent main-model tensors
(mlx-lm itself drops `mtp.*`, so it cannot do this for us):
- zero-centred RMSNorm weights get +1, exactly once;
- per-expert tensors (Qwen3-Next, Qwen3.5 MoE) are stacked into `switch_mlp`;
- fused `gate_up_proj` [E, 2I, H] (Qwen3.6) is split into gate / up halves.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Dict, Iterable, Tuple

import mlx.core as mx

MTP_PREFIX = "mtp."

# Norms stored zero-centred in HF form (effective weight 1 + w).
ZERO_CENTRED_NORMS = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)
_PER_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


class HeadConversionError(ValueError):
    pass


def safetensors_keys(path: Path) -> Dict[str, dict]:
    """Tensor names -> {dtype, shape} from a safetensors header, without reading data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def checkpoint_weight_map(folder: Path) -> Dict[str, str]:
    """tensor name -> shard file name, from the index if present, else from headers."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    weight_map = {}
    for shard in sorted(folder.glob("*.safetensors")):
        for name in safetensors_keys(shard):
            weight_map[name] = shard.name
    return weight_map


def mtp_tensor_files(folder: Path) -> Dict[str, str]:
    """`mtp.*` tensor name -> shard holding it (the head is often not in the last shard)."""
    return {k: v for k, v in checkpoint_weight_map(folder).items() if k.startswith(MTP_PREFIX)}


def load_mtp_tensors(folder: Path, files: Dict[str, str] = None) -> Dict[str, mx.array]:
    """Load only the `mtp.*` tensors (lazily: mx.load maps the shard, nothing else is read)."""
    files = files if files is not None else mtp_tensor_files(folder)
    out = {}
    for shard in sorted(set(files.values())):
        tensors = mx.load(str(folder / shard))
        out.update({k: v for k, v in tensors.items() if k.startswith(MTP_PREFIX)})
    return out


def expert_layout(names: Iterable[str]) -> str:
    """'per_expert', 'fused' or 'dense', from the tensor names (with or without `mtp.`)."""
    names = [n[len(MTP_PREFIX):] if n.startswith(MTP_PREFIX) else n for n in names]
    if any(_PER_EXPERT.match(n) for n in names):
        return "per_expert"
    if any(_FUSED.match(n) for n in names):
        return "fused"
    return "dense"


def num_head_layers(names: Iterable[str]) -> int:
    idx = {int(m.group(1)) for n in names if (m := re.match(r"^(?:mtp\.)?layers\.(\d+)\.", n))}
    return max(idx) + 1 if idx else 0


def num_experts(names: Iterable[str]) -> int:
    """Expert count from the tensors themselves (pruned models differ from their config)."""
    idx = {int(m.group(2)) for n in names if (m := _PER_EXPERT.match(n.removeprefix(MTP_PREFIX)))}
    return max(idx) + 1 if idx else 0


def is_zero_centred_norm(name: str) -> bool:
    return name == "norm.weight" or name.endswith(ZERO_CENTRED_NORMS)


def convert_hf_head(tensors: Dict[str, mx.array]) -> Tuple[Dict[str, mx.array], dict]:
    """HF `mtp.*` tensors -> (MTPHead parameter dict, info about the layout)."""
    if not tensors:
        raise HeadConversionError("no mtp.* tensors given")
    src = {k.removeprefix(MTP_PREFIX): v for k, v in tensors.items()}
    layout = expert_layout(src)
    out: Dict[str, mx.array] = {}
    stacks: Dict[Tuple[int, str], Dict[int, mx.array]] = {}
    for name, value in src.items():
        if m := _PER_EXPERT.match(name):
            stacks.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = value
        elif m := _FUSED.match(name):
            prefix = f"layers.{m.group(1)}.mlp.switch_mlp"
            if m.group(2) == "gate_up_proj":
                mid = value.shape[-2] // 2
                out[f"{prefix}.gate_proj.weight"] = value[..., :mid, :]
                out[f"{prefix}.up_proj.weight"] = value[..., mid:, :]
            else:
                out[f"{prefix}.down_proj.weight"] = value
        elif is_zero_centred_norm(name):
            if value.ndim != 1:
                raise HeadConversionError(f"norm {MTP_PREFIX}{name} has shape {value.shape}")
            out[name] = value + 1.0
        else:
            out[name] = value
    n_experts = 0
    for (layer, proj), experts in sorted(stacks.items()):
        n_experts = len(experts)
        if sorted(experts) != list(range(n_experts)):
            raise HeadConversionError(f"layer {layer} {proj}: expert indices are not 0..{n_experts - 1}")
        out[f"layers.{layer}.mlp.switch_mlp.{proj}.weight"] = mx.stack([experts[e] for e in range(n_experts)])
    if layout == "fused":
        gate = next(v for k, v in out.items() if k.endswith("switch_mlp.gate_proj.weight"))
        n_experts = gate.shape[0]
    info = {
        "expert_layout": layout,
        "num_experts": n_experts,
        "num_layers": num_head_layers(src),
        "moe": any(k.endswith("mlp.gate.weight") for k in out),
    }
    return out, info
