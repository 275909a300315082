"""Which Qwen family a checkpoint is, and where its parts live inside the mlx-lm model.

mlx-lm nests Qwen3.5 under `language_model`, Qwen3-Next is flat; everything else in
mlxmtp goes through `TextParts` so it never has to care.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

SUPPORTED = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


class UnsupportedModelError(ValueError):
    pass


def family_of(config: dict) -> str:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"model_type {model_type!r} has no MTP support in mlxmtp (supported: {', '.join(SUPPORTED)})"
        )
    return model_type


def text_config(config: dict) -> dict:
    """The flat text-model config: Qwen3.5 nests it under `text_config`."""
    return config.get("text_config", config)


@dataclass
class TextParts:
    """The pieces of an mlx-lm Qwen model that MTP decoding needs."""

    family: str
    text_model: nn.Module  # has .args, .model (the backbone) and maybe .lm_head
    args: Any  # mlx-lm ModelArgs / TextModelArgs

    @property
    def backbone(self) -> nn.Module:
        return self.text_model.model

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.backbone.embed_tokens

    @property
    def tied(self) -> bool:
        return bool(self.args.tie_word_embeddings)

    def lm_head(self, h: mx.array) -> mx.array:
        # Same call mlx-lm's TextModel.__call__ makes, so logits stay bit-identical.
        if self.tied:
            return self.embed_tokens.as_linear(h)
        return self.text_model.lm_head(h)

    def layer_factory(self) -> Callable[[], nn.Module]:
        """A constructor for one full-attention decoder layer of this family (the MTP layer)."""
        args = self.args
        attn_idx = args.full_attention_interval - 1  # an index whose layer is full attention
        # mlx_lm takes seconds to import: loaded on use (`mlxmtp inspect` never needs it).
        from mlx_lm.models import qwen3_5, qwen3_next

        Layer = qwen3_next.Qwen3NextDecoderLayer if self.family == "qwen3_next" else qwen3_5.DecoderLayer
        return lambda: Layer(args, attn_idx)


def text_parts(model: nn.Module) -> TextParts:
    model_type = getattr(model, "model_type", None) or model.args.model_type
    family = family_of({"model_type": model_type})
    text_model = model.language_model if hasattr(model, "language_model") else model
    return TextParts(family=family, text_model=text_model, args=text_model.args)


def mlp_classes(family: str):
    """(dense MLP class, sparse MoE class) of a family's decoder layers."""
    # mlx_lm takes seconds to import: loaded on use (`mlxmtp inspect` never needs it).
    from mlx_lm.models import qwen3_5, qwen3_next

    if family == "qwen3_next":
        return qwen3_next.Qwen3NextMLP, qwen3_next.Qwen3NextSparseMoeBlock
    return qwen3_5.MLP, qwen3_5.SparseMoeBlock


def attention_mask(h: mx.array, cache):
    """mlx-lm's attention mask for the tokens h [B, T, H] over `cache` (its own make_mask)."""
    # mlx_lm takes seconds to import: loaded on use (`mlxmtp inspect` never needs it).
    from mlx_lm.models.base import create_attention_mask

    return create_attention_mask(h, cache)
