"""Which supported family a checkpoint is (families/: one `Family` each), where its parts
live inside the mlx-lm model, and the check that the patches reached every layer.

mlx-lm nests Qwen3.5 under `language_model`, Qwen3-Next is flat; everything else in
mlxmtp goes through `TextParts` so it never has to care. Adding a family: see families/.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable, List, Tuple

import mlx.core as mx
import mlx.nn as nn

from .families import FAMILIES, PATCHED, SUPPORTED, Family


@functools.lru_cache(maxsize=None)
def patched_modules(kind: str) -> tuple:
    """Every family's mlx-lm modules whose `PATCHED[kind]` the patch for `kind` replaces."""
    modules = {id(m): m for m in (f.patched_module(kind) for f in FAMILIES.values())}
    return tuple(modules.values())


@functools.lru_cache(maxsize=None)
def layer_classes(kind: str) -> Tuple[type, ...]:
    """Every family's mlx-lm class of `kind` ("linear_attention", "attention", ...)."""
    return tuple({f.layer_class(kind) for f in FAMILIES.values()})


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
    def spec(self) -> Family:
        return FAMILIES[self.family]

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
        Layer = self.spec.layer_class("decoder_layer")
        return lambda: Layer(args, attn_idx)


def text_parts(model: nn.Module) -> TextParts:
    model_type = getattr(model, "model_type", None) or model.args.model_type
    family = family_of({"model_type": model_type})
    text_model = model.language_model if hasattr(model, "language_model") else model
    return TextParts(family=family, text_model=text_model, args=text_model.args)


def mlp_classes(family: str):
    """(dense MLP class, sparse MoE class) of a family's decoder layers."""
    spec = FAMILIES[family]
    return spec.layer_class("mlp"), spec.layer_class("moe")


def attention_mask(h: mx.array, cache):
    """mlx-lm's attention mask for the tokens h [B, T, H] over `cache` (its own make_mask)."""
    # mlx_lm takes seconds to import: loaded on use (`mlxmtp inspect` never needs it).
    from mlx_lm.models.base import create_attention_mask

    return create_attention_mask(h, cache)


class UnpatchedLayerError(RuntimeError):
    """A layer of the model is one no supported family declares, or one a patch missed."""


def check_patched(layers: List[nn.Module]) -> None:
    """Refuse, before the first forward, a model whose layers the patches did not all reach
    (called once they are installed): each layer must be the decoder layer of a supported
    family, with that family's attention classes, each calling the patched function and the
    Gated DeltaNet its recording conv. A family added without its patches fails here, at
    start-up, rather than at its first rollback."""
    # mlx_lm takes seconds to import: loaded on use (`mlxmtp inspect` never needs it).
    from mlx_lm.models import base, gated_delta

    stock = {"gated_delta_update": gated_delta.gated_delta_update,
             "scaled_dot_product_attention": base.scaled_dot_product_attention}
    for i, layer in enumerate(layers):
        spec = next((f for f in FAMILIES.values() if type(layer) is f.layer_class("decoder_layer")), None)
        if spec is None:
            raise UnpatchedLayerError(f"layer {i} is a {type(layer).__name__}, which no supported family "
                                      f"({', '.join(SUPPORTED)}) declares")
        kind, part = ("linear_attention", layer.linear_attn) if layer.is_linear else ("attention", layer.self_attn)
        name = PATCHED[kind]
        looked_up = getattr(sys.modules[type(part).__module__], name, stock[name])
        if type(part) is not spec.layer_class(kind) or looked_up is stock[name] or (
                kind == "linear_attention" and type(part.conv1d) is nn.Conv1d):
            raise UnpatchedLayerError(f"layer {i} ({type(part).__module__}.{type(part).__name__}) is not patched "
                                      f"for {spec.model_type}: its {name} or its class is not the one mlxmtp "
                                      "patches (mlxmtp/mlxlm/families/)")
