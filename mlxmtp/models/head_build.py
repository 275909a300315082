"""Building the MTP head from its located weights: an `MTPHead` of mlx-lm's own layer
classes, quantized as the weights were saved, checked against the model (shapes, the
norms' +1 shift) and materialised."""

from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from ..checkpoint import hf_head, norm_convention
from ..mlxlm.family import TextParts
from . import head_layouts
from .errors import MTPLoadError
from .mtp_head import MTPHead


def quantize_like(module: nn.Module, quantization: dict, weights: Dict[str, mx.array]) -> None:
    """Make `module` quantized like the saved weights, as mlx-lm's loader does for a model:
    per-path overrides first, then every layer whose `scales` were saved."""

    def predicate(path, m):
        if path in quantization:
            return quantization[path]
        if not hasattr(m, "to_quantized"):
            return False
        return f"{path}.scales" in weights

    nn.quantize(
        module,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def build_head(parts: TextParts, weights: Dict[str, mx.array], info: dict,
               quantization: Optional[dict] = None) -> MTPHead:
    head = MTPHead(parts, num_layers=max(1, info["num_layers"]), moe=info["moe"])
    if not quantization:  # pre-quantized `mtp.*` tensors say how only by their widths
        try:
            quantization = head_layouts.infer_quantization(head, weights)
        except ValueError as e:
            raise MTPLoadError(f"{e}. Rebuild the head with mlxmtp add-mtp-weights --force.") from e
    if quantization:
        quantize_like(head, quantization, weights)
    _check_fits(head, weights)
    head.load_weights(list(weights.items()), strict=True)
    head.eval()
    if not quantization and mx.default_device() == mx.cpu:
        # MLX's CPU kernels for float16/bfloat16 are slower than float32 (no BLAS), and the
        # head's steps are on the critical path of every cycle: compute it in float32 there.
        # (Drafts are always verified, so this can only change acceptance, never output.)
        head.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype in (mx.float16, mx.bfloat16) else a,
                             head.parameters()))
    # Materialise now: MLX streams are per thread, and a server evaluates on its engine thread.
    mx.eval(head.parameters())
    return head


def _check_fits(head: MTPHead, weights: Dict[str, mx.array]) -> None:
    """Refuse weights whose names or shapes are not the head's (another model's head)."""
    expected = dict(tree_flatten(head.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(expected) & set(weights) if expected[k].shape != weights[k].shape)
    if not (missing or extra or wrong):
        return
    details = []
    if missing:
        details.append(f"missing {missing[:5]}")
    if extra:
        details.append(f"unexpected {extra[:5]}")
    if wrong:
        k = wrong[0]
        details.append(
            f"{len(wrong)} shape mismatches, e.g. {k}: head has {tuple(weights[k].shape)}, "
            f"model expects {tuple(expected[k].shape)}"
        )
    raise MTPLoadError(
        "the MTP head does not match this model (" + "; ".join(details) + "). "
        "Was it taken from another model?"
    )


def check_norm_convention(reference: norm_convention.NormReference, head: MTPHead) -> None:
    """Refuse double-shifted (or never-shifted) head norms (norm_convention.misshifted_norms);
    `reference`: the model's own norms (norm_convention.norm_reference)."""
    norms = ((name, w) for name, w in tree_flatten(head.parameters())
             if hf_head.is_zero_centred_norm(name) and w.ndim == 1)
    bad = next(norm_convention.misshifted_norms(norms, reference), None)
    if bad is not None:
        lo, hi = bad.span
        raise MTPLoadError(
            f"MTP head norm {bad.name} looks {'shifted twice' if bad.twice else 'never shifted'} (mean "
            f"effective weight {bad.mean:.2f}; the model's own norms of its kind: {lo:.2f}-{hi:.2f}): the +1 "
            "zero-centred RMSNorm shift must be applied exactly once. Rebuild the head with "
            "mlxmtp add-mtp-weights --force."
        )
