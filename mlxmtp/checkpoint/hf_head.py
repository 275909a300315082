"""Turn the `mtp.*` tensors of an HF checkpoint into MTPHead parameters.

Done exactly as mlx-lm's `sanitize` treats the equivalent main-model tensors
(mlx-lm itself drops `mtp.*`, so it cannot do this for us):
- zero-centred RMSNorm weights get +1, exactly once;
- per-expert tensors (Qwen3-Next, Qwen3.5 MoE) are stacked into `switch_mlp`;
- fused `gate_up_proj` [E, 2I, H] (Qwen3.6) is split into gate / up halves.

Heads that other tools leave in MLX folders go the same way: a sidecar file beside the
shards (SIDECARS, or the one the config names), MLX-quantized layers (`.weight` packed,
`.scales`, `.biases`: stacked and copied like the weight), names already in MTPHead form
(`switch_mlp`, passed through) and norms already shifted (`convert_hf_head(...,
shift_norms=False)`; the loader decides which from the values, models/head_layouts.py).

`map_head_names` is the one statement of that mapping, by name only: `convert_hf_head`
applies it to tensors in memory (the loader), the converter (convert/add_mtp_weights.py)
to tensors it reads a piece at a time. norm_convention.py checks the result.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

import mlx.core as mx

from .tensor_files import read_header

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
_PER_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")
_FUSED = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
# Files other tools keep a head in, beside the shards an index lists (names relative to the
# folder); a config may name another (`mlx_lm_extra_tensors.mtp_file`, `declared_sidecar`).
SIDECARS = ("mtp.safetensors", "model-mtp.safetensors", "mtp/weights.safetensors", "optiq/mtp.safetensors")


class HeadConversionError(ValueError):
    pass


# ---------------------------------------------------------------------------
# Where the head's tensors are
# ---------------------------------------------------------------------------


def checkpoint_weight_map(folder: Path) -> Dict[str, str]:
    """tensor name -> shard file name, from the index if present, else from headers."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    weight_map = {}
    for shard in sorted(folder.glob("*.safetensors")):
        header, _ = read_header(shard)
        for name in header:
            weight_map[name] = shard.name
    return weight_map


def mtp_tensor_files(folder: Path) -> Dict[str, str]:
    """`mtp.*` tensor name -> file holding it, relative to `folder`: a shard (the head is
    often not in the last one) or a sidecar file the index does not list (SIDECARS)."""
    folder = Path(folder)
    weight_map = checkpoint_weight_map(folder)
    listed = set(weight_map.values())
    declared = declared_sidecar(folder)
    for name in dict.fromkeys(([declared] if declared else []) + list(SIDECARS)):  # once each, in order
        if name not in listed and (folder / name).is_file():
            header, _ = read_header(folder / name)
            weight_map.update({tensor: name for tensor in header})
    return {k: v for k, v in weight_map.items() if k.startswith(MTP_PREFIX)}


def declared_sidecar(folder: Path):
    """The head file the folder's config names under `mlx_lm_extra_tensors.mtp_file` (a
    convention of several MLX MTP runtimes), when it is a path inside the folder; else None."""
    try:
        extra = json.loads((Path(folder) / "config.json").read_text()).get("mlx_lm_extra_tensors")
    except (OSError, ValueError, AttributeError):  # no config, not JSON, not an object
        return None
    name = extra.get("mtp_file") if isinstance(extra, dict) else None
    if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
        return None
    return name


def load_mtp_tensors(folder: Path, files: Dict[str, str] = None) -> Dict[str, mx.array]:
    """Load only the `mtp.*` tensors (lazily: mx.load maps the shard, nothing else is read)."""
    files = files if files is not None else mtp_tensor_files(folder)
    out = {}
    for shard in sorted(set(files.values())):
        tensors = mx.load(str(folder / shard))
        out.update({k: v for k, v in tensors.items() if k.startswith(MTP_PREFIX)})
    return out


# ---------------------------------------------------------------------------
# The head's layout, from the names
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# The mapping: HF names -> MTPHead parameters
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadTensor:
    """One MTPHead parameter and the HF tensors it is made of."""

    out: str  # MTPHead parameter name, e.g. "layers.0.mlp.switch_mlp.gate_proj.weight"
    kind: str  # copy | norm | stack | gate_half | up_half
    sources: Tuple[str, ...]  # HF names as given (stack: ordered by expert)


def map_head_names(names: Iterable[str]) -> Tuple[List[HeadTensor], dict]:
    """The MTPHead parameters that HF `mtp.*` tensor names (with or without the prefix)
    make, sorted by source name, experts stacked last; and the layout info
    {expert_layout, num_experts, num_layers, moe}. A fused layout's expert count is not
    in its names: num_experts is 0 there (it is gate_up_proj's first axis)."""
    names = sorted(names)
    out: List[HeadTensor] = []
    stacks: Dict[Tuple[int, str], Dict[int, str]] = {}
    for full in names:
        name = full.removeprefix(MTP_PREFIX)
        if m := _PER_EXPERT.match(name):
            stacks.setdefault((int(m.group(1)), f"{m.group(3)}.{m.group(4)}"), {})[int(m.group(2))] = full
        elif m := _FUSED.match(name):
            prefix = f"layers.{m.group(1)}.mlp.switch_mlp"
            if m.group(2) == "gate_up_proj":
                out.append(HeadTensor(f"{prefix}.gate_proj.weight", "gate_half", (full,)))
                out.append(HeadTensor(f"{prefix}.up_proj.weight", "up_half", (full,)))
            else:
                out.append(HeadTensor(f"{prefix}.down_proj.weight", "copy", (full,)))
        else:
            out.append(HeadTensor(name, "norm" if is_zero_centred_norm(name) else "copy", (full,)))
    stacked, n_experts = _stack_experts(stacks)
    out += stacked
    info = {
        "expert_layout": expert_layout(names),
        "num_experts": n_experts,
        "num_layers": num_head_layers(names),
        "moe": any(t.out.endswith("mlp.gate.weight") for t in out),
    }
    return out, info


def _stack_experts(stacks: Dict[Tuple[int, str], Dict[int, str]]) -> Tuple[List[HeadTensor], int]:
    """One `switch_mlp` parameter per (layer, projection) of per-expert tensors; the expert count."""
    out, n_experts = [], 0
    for (layer, proj), experts in sorted(stacks.items()):
        n = len(experts)
        if sorted(experts) != list(range(n)):
            raise HeadConversionError(f"layer {layer} {proj}: expert indices are not 0..{n - 1}")
        if n_experts and n != n_experts:
            raise HeadConversionError(f"layer {layer} {proj} has {n} experts, other projections {n_experts}")
        n_experts = n
        out.append(HeadTensor(f"layers.{layer}.mlp.switch_mlp.{proj}", "stack",
                              tuple(experts[e] for e in range(n))))
    return out, n_experts


def head_form(kind: str, w: mx.array) -> mx.array:
    """One source tensor (or a range of its experts) in MTPHead form, for every kind but
    `stack` (whose sources are stacked as they are)."""
    if kind == "norm":
        return w + 1.0  # zero-centred RMSNorm: +1 exactly once (as mlx-lm's sanitize)
    if kind in ("gate_half", "up_half"):
        mid = w.shape[-2] // 2
        return w[..., :mid, :] if kind == "gate_half" else w[..., mid:, :]
    return w


def convert_hf_head(tensors: Dict[str, mx.array], shift_norms: bool = True) -> Tuple[Dict[str, mx.array], dict]:
    """HF `mtp.*` tensors -> (MTPHead parameter dict, info about the layout). `shift_norms`
    False: the norms were shifted already (a head an MLX conversion kept)."""
    if not tensors:
        raise HeadConversionError("no mtp.* tensors given")
    mapping, info = map_head_names(tensors)
    out: Dict[str, mx.array] = {}
    for t in mapping:
        if t.kind == "stack":
            out[t.out] = mx.stack([tensors[s] for s in t.sources])
            continue
        value = tensors[t.sources[0]]
        if t.kind == "norm" and value.ndim != 1:
            raise HeadConversionError(f"norm {MTP_PREFIX}{t.out} has shape {value.shape}")
        out[t.out] = value if t.kind == "norm" and not shift_norms else head_form(t.kind, value)
    if info["expert_layout"] == "fused":
        gate = next(v for k, v in out.items() if k.endswith("switch_mlp.gate_proj.weight"))
        info["num_experts"] = gate.shape[0]
    return out, info
