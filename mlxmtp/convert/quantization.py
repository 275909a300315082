"""How the repaired head is quantized: as asked, `auto` like the target model, each path
treated as the target's main layers treat it (router, shared_expert_gate, layers left plain)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import mlx.nn as nn

from ..mlxlm.family import text_config, text_parts
from .plan import AddMTPError, Plan
from .target import head_skeleton

# mlx-lm's defaults per quantization mode (utils.quantize_model: defaults_for_mode).
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}


def _parse_bits(bits) -> Optional[int]:
    if bits in (None, "auto"):
        return None
    b = int(bits)
    if b not in (2, 3, 4, 5, 6, 8, 16):
        raise AddMTPError(f"--bits must be auto, 2, 3, 4, 5, 6, 8 or 16 (got {bits})")
    return b


_LAYER_SUFFIX = re.compile(r"(?:^|\.)layers\.\d+\.(.+)$")


def _module_quant(m) -> Optional[dict]:
    if hasattr(m, "bits") and hasattr(m, "group_size") and hasattr(m, "scales"):
        return {"group_size": int(m.group_size), "bits": int(m.bits), "mode": getattr(m, "mode", "affine")}
    return None


def target_treatment(target) -> Dict[str, Optional[dict]]:
    """How the target's main layers are quantized, per layer-relative path (e.g. "mlp.gate"
    -> {"bits": 8, "group_size": 64, "mode": "affine"}, or None for left unquantized):
    the most common treatment over all layers."""
    seen: Dict[str, Counter] = {}
    for path, m in text_parts(target).backbone.named_modules():
        mm = _LAYER_SUFFIX.search(path)
        if not mm or not (hasattr(m, "to_quantized") or _module_quant(m)) or isinstance(m, nn.Embedding):
            continue
        q = _module_quant(m)
        key = None if q is None else tuple(sorted(q.items()))
        seen.setdefault(mm.group(1), Counter())[key] += 1
    return {s: (None if c.most_common(1)[0][0] is None else dict(c.most_common(1)[0][0]))
            for s, c in seen.items()}


@dataclass
class QuantRequest:
    """The head's quantization as the options ask for it, `auto` resolved from the target."""

    bits: int  # 16: none
    group_size: int
    mode: str
    target: Optional[dict]  # the target config's quantization; None for an unquantized target

    @property
    def origin(self) -> str:
        return "target config" if self.target else "target is unquantized"


def quant_request(target_config: dict, bits="auto", group_size="auto", mode="auto") -> QuantRequest:
    tq = target_config.get("quantization") or text_config(target_config).get("quantization")
    want_bits = _parse_bits(bits)
    if mode in (None, "auto"):
        mode = (tq or {}).get("mode", "affine")
    if mode not in MODE_DEFAULTS:
        raise AddMTPError(f"--mode must be auto or one of {sorted(MODE_DEFAULTS)} (got {mode})")
    if want_bits is None:
        want_bits = int(tq["bits"]) if tq else 16
    if group_size in (None, "auto"):
        gs = int(tq["group_size"]) if tq and "group_size" in tq else MODE_DEFAULTS[mode][0]
    else:
        gs = int(group_size)
    return QuantRequest(want_bits, gs, mode, tq)


def choose_quantization(p: Plan, target, *, bits="auto", group_size="auto", mode="auto") -> None:
    """Each job's quantization and the head's (mlx-lm style) quantization dict: as asked,
    `auto` like the target, each path treated as the target's main layers treat it."""
    req = quant_request(p.target_config, bits, group_size, mode)
    for job in p.jobs:
        job.quant = None
    if req.bits == 16:
        p.quantization = None
        p.choice = [f"quantization: none, head kept in the source dtype {p.dtype} (--bits 16 / {req.origin})"]
        return
    default = {"group_size": req.group_size, "bits": req.bits, "mode": req.mode}
    p.quantization, notes = _quantize_jobs(p, target, default, req.target)
    src = "--bits" if bits not in (None, "auto") else req.origin
    p.choice = [f"quantization: {req.bits}-bit, group size {req.group_size}, mode {req.mode} ({src}); "
                f"scales in the source dtype {p.dtype}"] + notes


def _quantize_jobs(p: Plan, target, default: dict, tq: Optional[dict]) -> Tuple[dict, List[str]]:
    """Set each quantizable job's quantization; (the head's quantization dict, lines on
    the paths treated otherwise than `default`)."""
    treatment = target_treatment(target) if tq else {}
    target_default = _config_default(tq)
    # Suffixes the target's config names per path (mlx-lm records its router / shared_expert_gate
    # overrides even when they equal the default): record them for the head too.
    named = {mm.group(1) for k, v in (tq or {}).items()
             if isinstance(v, dict) and (mm := _LAYER_SUFFIX.search(k))}
    quantizable = {path for path, m in head_skeleton(target, p.info).named_modules()
                   if hasattr(m, "to_quantized") and not isinstance(m, nn.Embedding)}
    quant: dict = dict(default)
    overrides, skipped, mirrored_plain = [], [], []
    for job in p.jobs:
        path = job.out.removesuffix(".weight")
        if not job.out.endswith(".weight") or path not in quantizable:
            continue
        mm = _LAYER_SUFFIX.search(path)
        suffix = mm.group(1) if mm else None
        params = _like_target(suffix, default, treatment, target_default)
        if params is None:  # the target kept its main layers' equivalent unquantized
            mirrored_plain.append(path)
            continue
        in_dim = job.shape[-1] if job.shape else 0
        if in_dim % params["group_size"] != 0:  # mlx-lm leaves these unquantized too
            skipped.append(f"{path} (input dim {in_dim})")
            continue
        job.quant = dict(params)
        if params != default or suffix in named:
            quant[path] = dict(params)
            overrides.append(f"{path} {params['bits']}-bit group {params['group_size']} {params['mode']}")
    return quant, _quantization_notes(overrides, mirrored_plain, skipped)


def _config_default(tq: Optional[dict]) -> Optional[dict]:
    """The target config's default quantization, in the form of `_module_quant`."""
    if not tq:
        return None
    return {"group_size": int(tq.get("group_size", 64)), "bits": int(tq["bits"]), "mode": tq.get("mode", "affine")}


def _like_target(suffix: Optional[str], default: dict, treatment: Dict[str, Optional[dict]],
                 target_default: Optional[dict]) -> Optional[dict]:
    """A head path's quantization: the target's per-path override where its main layers have
    one (router, shared_expert_gate), None where they are unquantized, else `default`."""
    if suffix not in treatment:
        return default
    t = treatment[suffix]
    if t is None:
        return None
    return default if t == target_default else t


def _quantization_notes(overrides: List[str], mirrored_plain: List[str], skipped: List[str]) -> List[str]:
    notes = []
    if overrides:
        notes.append("  like the target's main layers: " + "; ".join(overrides))
    if mirrored_plain:
        notes.append("  unquantized like the target's main layers: " + ", ".join(mirrored_plain))
    if skipped:
        notes.append(f"  unquantized, not divisible by the group size: {', '.join(skipped)}")
    return notes
