"""Pipeline split of an mlx-lm Qwen backbone over the ranks of an `mx.distributed` group.

mlx-lm's Qwen3-Next and Qwen3.5 backbones have it built in (`PipelineMixin.pipeline`):
rank r keeps `split[r]` consecutive layers (the last rank the first layers, rank 0 the
last), drops the others before their weights are read, receives the hidden states from
rank r+1, sends them on to rank r-1, and an all-gather gives every rank the final
hidden states. Every rank keeps the embeddings, the final norm and the lm_head, so every
rank computes the same logits from the same gathered hidden states.
"""

from __future__ import annotations

from typing import List, Sequence

import mlx.nn as nn


def split_backbone(backbone: nn.Module, group, split: Sequence[int]) -> None:
    """Keep only this rank's layers of `backbone` (`split[r]`: layers of rank r)."""
    backbone.pipeline(group, split=list(split))


def local_layers(backbone: nn.Module) -> List[nn.Module]:
    """The layers this process runs: all of them, or its share of a pipeline split."""
    return list(getattr(backbone, "pipeline_layers", backbone.layers))

