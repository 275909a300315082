"""Heads that other tools leave in MLX model folders, read as they are.

mlxmtp's own `mtp/` folder records how its head was made (norms shifted, quantization).
Other MTP runtimes and mlx-lm conversions that keep the head store `mtp.*` tensors
without saying so: in the shards or a sidecar file (checkpoint/hf_head.SIDECARS), in HF
names or MTPHead's, MLX-quantized layer by layer (`weight`, `scales`, `biases`), their
zero-centred norms shifted or not. What is not written down is read off the tensors:

- the norm convention: the +1 shift moves every norm of the head by 1, so of the head
  shifted and the head as stored, the one whose norms sit nearer the model's own norms of
  the same kind (summed over the norms: checkpoint/norm_convention.py) is the right one;
- the quantization of each layer: bits and group size from the packed weight's and the
  scales' widths against the layer's input size in the unquantized head.
Only MLX's affine mode is read (it is the one with biases); another is refused by name.
"""

from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..checkpoint import hf_head, norm_convention


def convert_settling_norms(tensors: Dict[str, mx.array], reference: norm_convention.NormReference):
    """hf_head.convert_hf_head of `tensors`, the +1 norm shift left out where the head's
    norms sit nearer the model's norms (`reference`) without it than with it."""
    weights, info = hf_head.convert_hf_head(tensors)
    norms = {name: w for name, w in weights.items() if hf_head.is_zero_centred_norm(name) and w.ndim == 1}
    if norm_convention.shifted_already(norms, reference):
        weights, info = hf_head.convert_hf_head(tensors, shift_norms=False)
    return weights, info


def infer_quantization(head: nn.Module, weights: Dict[str, mx.array]) -> Optional[dict]:
    """The quantization of pre-quantized `weights` for the unquantized `head` they are
    for, in mlx-lm's form ({"group_size", "bits", "mode", path: {...} per layer}), or
    None when no layer is quantized. A layer without `biases` (not affine) or with widths
    no (bits, group size) explains is a ValueError naming it."""
    shapes = {name: w.shape for name, w in tree_flatten(head.parameters())}
    layers = {}
    for key in (k for k in weights if k.endswith(".scales")):
        path = key[: -len(".scales")]
        if f"{path}.biases" not in weights:
            raise ValueError(f"the MTP head's {path} is quantized in a mode other than MLX's affine one")
        if f"{path}.weight" not in shapes:
            raise ValueError(f"the MTP head has no layer {path} to quantize")
        inputs = shapes[f"{path}.weight"][-1]
        packed, groups = weights[f"{path}.weight"].shape[-1], weights[key].shape[-1]
        bits, group_size = packed * 32 // inputs, inputs // max(groups, 1)
        if packed * 32 != bits * inputs or group_size * groups != inputs or bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"the MTP head's {path} has widths of no MLX quantization "
                             f"(weight {packed} x 32 bits and {groups} groups for {inputs} inputs)")
        layers[path] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    if not layers:
        return None
    first = next(iter(layers.values()))
    return {**first, **layers}
