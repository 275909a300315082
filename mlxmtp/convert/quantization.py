"""How the repaired head is quantized: as asked, `auto` like the target model, each path
treated as the target's main layers treat it (router, shared_expert_gate, layers left plain)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..mlxlm.family import text_config, text_parts
from .plan import AddMTPError, Plan
from .target import cpu, head_skeleton

# mlx-lm's defaults per quantization mode (utils.quantize_model: defaults_for_mode).
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}


def _parse_bits(bits) -> Optional[int]:
    if bits in (None, "auto"):
        return None
    try:
        b = int(bits)
    except (TypeError, ValueError):
        b = None
    if b not in (2, 3, 4, 5, 6, 8, 16):
        raise AddMTPError(f"--bits must be auto, 2, 3, 4, 5, 6, 8 or 16 (got {bits})")
    return b


def _parse_group_size(group_size) -> Optional[int]:
    if group_size in (None, "auto"):
        return None
    try:
        gs = int(group_size)
    except (TypeError, ValueError):
        gs = 0
    if gs <= 0:
        raise AddMTPError(f"--group-size must be auto or a positive integer (got {group_size})")
    return gs


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
    origin: str = "auto: target config"  # where the bits and group size not given came from


def quant_request(target_config: dict, bits="auto", group_size="auto", mode="auto") -> QuantRequest:
    """The options resolved and checked, before any work: `auto` takes the target's setting
    where the target is quantized in the same mode, else the mode's own (mxfp4, nvfp4, mxfp8
    allow one group size and bits only); a combination MLX refuses is an AddMTPError."""
    tq = target_config.get("quantization") or text_config(target_config).get("quantization")
    want_bits, gs = _parse_bits(bits), _parse_group_size(group_size)
    asked_mode = mode not in (None, "auto")
    if not asked_mode:
        mode = (tq or {}).get("mode", "affine")
    if mode not in MODE_DEFAULTS:
        raise AddMTPError(f"--mode must be auto or one of {sorted(MODE_DEFAULTS)} (got {mode})")
    if tq and tq.get("mode", "affine") == mode:
        like = (int(tq["bits"]), int(tq.get("group_size", MODE_DEFAULTS[mode][0])), "target config")
    elif tq or asked_mode:
        like = (MODE_DEFAULTS[mode][1], MODE_DEFAULTS[mode][0], f"{mode} defaults")
    else:
        like = (16, MODE_DEFAULTS[mode][0], "target is unquantized")
    origin = "as given" if want_bits is not None and gs is not None else f"auto: {like[2]}"
    req = QuantRequest(like[0] if want_bits is None else want_bits, like[1] if gs is None else gs,
                       mode, tq, origin)
    _check_mlx_takes(req, bits, group_size, asked_mode)
    return req


# Group sizes past this are refused without asking MLX (its trial array has 8 groups: nvfp4
# refuses a single group of 16).
_MAX_GROUP_SIZE = 1 << 16


def _check_mlx_takes(req: QuantRequest, bits, group_size, asked_mode: bool) -> None:
    """Quantize a tiny array as the head would be: MLX's own rules, refused in one line."""
    if req.bits == 16:
        return
    shown = " ".join(f"{opt} {val}{'' if given else ' (auto)'}" for opt, val, given in (
        ("--mode", req.mode, asked_mode), ("--bits", req.bits, bits not in (None, "auto")),
        ("--group-size", req.group_size, group_size not in (None, "auto"))))
    why = None
    if req.group_size > _MAX_GROUP_SIZE:
        why = "group size too large"
    else:
        try:
            with cpu():
                mx.eval(*mx.quantize(mx.zeros((1, 8 * req.group_size)), group_size=req.group_size,
                                     bits=req.bits, mode=req.mode))
        except (ValueError, RuntimeError) as e:
            why = str(e).removeprefix("[quantize]").strip()
    if why:
        raise AddMTPError(f"cannot quantize the head with {shown}: {why}")


def choose_quantization(p: Plan, target, req: QuantRequest) -> None:
    """Each job's quantization and the head's (mlx-lm style) quantization dict: as asked
    (`req`: `quant_request` of the options), `auto` like the target, each path treated as the
    target's main layers treat it."""
    for job in p.jobs:
        job.quant = None
    if req.bits == 16:
        p.quantization = None
        p.choice = [f"quantization: none, head kept in the source dtype {p.dtype} "
                    f"({'--bits 16' if req.target else 'target is unquantized'})"]
        return
    default = {"group_size": req.group_size, "bits": req.bits, "mode": req.mode}
    p.quantization, notes = _quantize_jobs(p, target, default, req.target)
    scales = f"scales in the source dtype {p.dtype}" if req.mode == "affine" else "scales 8-bit"
    p.choice = [f"quantization: {req.bits}-bit, group size {req.group_size}, mode {req.mode} "
                f"({req.origin}); {scales}"] + notes


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
