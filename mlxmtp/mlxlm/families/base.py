"""What a supported family declares (`Family`), and what mlxmtp patches in its layers."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Optional

# What mlxmtp patches for each kind of layer: the function the layer's own mlx-lm module
# looks up by name at call time, replaced in that module (gdn_capture.py: the Gated
# DeltaNet's recurrence, recorded for rollback; row_attention.py: attention per row group).
PATCHED = {"linear_attention": "gated_delta_update", "attention": "scaled_dot_product_attention"}


@dataclass(frozen=True)
class Family:
    """One supported family: the names of its layer classes in `mlx_lm.models.<module>`
    (defined there or taken from another family's file), and how its HF checkpoints name
    their tensors (`text_prefix`: where the text model's are; `expert_layout`: how the
    backbone stores its experts, "per_expert" or "fused", None when it has none)."""

    model_type: str
    module: str
    decoder_layer: str
    linear_attention: str  # the Gated DeltaNet
    attention: str
    mlp: str
    moe: str
    text_prefix: str
    expert_layout: Optional[str]

    def layer_class(self, kind: str) -> type:
        """The mlx-lm class of one of the fields above ("decoder_layer", "attention", ...)."""
        # mlx_lm takes seconds to import: loaded on use (`mlxmtp inspect` never needs it).
        return getattr(importlib.import_module(f"mlx_lm.models.{self.module}"), getattr(self, kind))

    def patched_module(self, kind: str):
        """The mlx-lm module whose `PATCHED[kind]` the layers of `kind` call: their class's own."""
        return sys.modules[self.layer_class(kind).__module__]
