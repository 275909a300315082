"""The MTP head of Qwen3-Next / Qwen3.5 / Qwen3.6 (see shared docs, "The forward pass of the head").

    x  = fc(concat([norm_e(embed(token_{i+1})), norm_h(h_i)]))   # embedding FIRST
    x  = decoder_layer(x)          # a full-attention layer of the main model's own class
    h' = norm(x)                   # fed to the shared lm_head, and chained for draft k > 1

The decoder layer is mlx-lm's own class, built with the main model's args, so the
head inherits its attention (gated q_proj, q/k norms, partial RoPE) and MLP/MoE.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn

from ..mlxlm.family import TextParts, attention_mask, mlp_classes


class MTPHead(nn.Module):
    def __init__(self, parts: TextParts, num_layers: int = 1, moe: Optional[bool] = None):
        super().__init__()
        args = parts.args
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        make_layer = parts.layer_factory()
        self.layers = [make_layer() for _ in range(num_layers)]
        if moe is not None:
            _force_mlp_kind(self.layers, parts, moe)
        self.norm = nn.RMSNorm(hidden, eps=eps)

    def __call__(
        self,
        embeddings: mx.array,
        hidden: mx.array,
        cache: Optional[List] = None,
        mask=None,
    ) -> mx.array:
        """embeddings, hidden: [B, T, H]. Returns the normed head state h' [B, T, H]."""
        dtype = self.norm.weight.dtype  # the head may compute in a wider type than the model
        if embeddings.dtype != dtype:
            embeddings, hidden = embeddings.astype(dtype), hidden.astype(dtype)
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        if cache is None:
            cache = [None] * len(self.layers)
        if mask is None and (x.shape[1] > 1 or cache[0] is not None):
            # None for one token over a sliced cache; an explicit mask where the cache hands
            # over its whole buffer (RaggedKVCache's shape-stable mode), one token included.
            mask = attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask=mask, cache=c)
        return self.norm(x)


def _force_mlp_kind(layers, parts: TextParts, moe: bool) -> None:
    """The head's MLP kind comes from its tensors, not from config rules such as
    `decoder_sparse_step` / `mlp_only_layers`, which describe the main layers."""
    args = parts.args
    MLP, MoE = mlp_classes(parts.family)
    for layer in layers:
        is_moe = isinstance(layer.mlp, MoE)
        if moe and not is_moe:
            layer.mlp = MoE(args)
        elif not moe and is_moe:
            layer.mlp = MLP(args.hidden_size, args.intermediate_size)
