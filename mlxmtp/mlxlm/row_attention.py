"""Attention for a batch whose rows have very different lengths: one call per group of rows.

A batch's attention buffers hold every row at the capacity of its longest row
(`RaggedKVCache`, like mlx-lm's `BatchKVCache`), and one attention call over them reads
every row's keys and values up to that length. Next to one 100K-token conversation, a
2K-token one then reads 50 times the KV it needs in every layer and every step: on a GPU,
where decoding is bound by memory bandwidth, that is most of a step once contexts are long.

So when rows differ enough, the cache splits the batch into runs of neighbouring rows
(`plan_groups`) and the attention is called once per run, over that run's own extent only.
Each call is mlx-lm's own `scaled_dot_product_attention` (the fused kernel wherever MLX has
one); a run of rows of one length attends exactly as a lone row does (no mask for one token,
"causal" for several), and other runs take their part of the batch's mask. Where the cache
planned no split, the attention is mlx-lm's call on the whole batch, unchanged.

mlx-lm has no per-row attention (its batch cache pads too); vLLM's paged attention reads
each row's own blocks. This keeps mlx-lm's buffers and kernels and only cuts what is read.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Tuple

import mlx.core as mx
from mlx_lm.models import base

from .family import patched_modules

# A separate attention call is made when it saves at least this many key positions that the
# padded call would read (summed over the rows): below that, one more launch costs more than
# the reads it saves. Positions, not bytes: a position of one layer's KV is a few KiB in
# these models (2-4 KV heads of 256), a few microseconds' worth of launches on a GPU.
CALL_COST_POSITIONS = 1024

Group = Tuple[int, int, int]  # rows [start, stop) attending over keys [0, extent)

_mlx_lm_attention = base.scaled_dot_product_attention


def plan_groups(extents: Tuple[int, ...], call_cost: Optional[int] = None) -> Optional[Tuple[Group, ...]]:
    """Runs of neighbouring rows, each to attend over its longest row's extent, chosen to
    read the fewest key positions, each call after the first counted as `call_cost` more.
    None when one call over the whole batch is best (rows of similar lengths)."""
    cost = CALL_COST_POSITIONS if call_cost is None else call_cost
    if len(extents) * max(extents, default=0) - sum(extents) <= cost:
        return None  # no split can save more than one call costs
    return _cheapest_runs(tuple(extents), cost)


@lru_cache(maxsize=64)  # every attention layer of a forward asks with the same extents
def _cheapest_runs(extents: Tuple[int, ...], cost: int) -> Optional[Tuple[Group, ...]]:
    B = len(extents)
    # best[j]: the cheapest split of rows [0, j); cut[j]: where its last run starts.
    best, cut = [0] + [None] * B, [0] * (B + 1)
    for j in range(1, B + 1):
        longest = 0
        for i in range(j - 1, -1, -1):
            longest = max(longest, extents[i])
            c = best[i] + (j - i) * longest + (cost if i > 0 else 0)
            if best[j] is None or c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], B
    while j > 0:
        i = cut[j]
        groups.append((i, j, max(extents[i:j])))
        j = i
    return tuple(groups[::-1]) if len(groups) > 1 else None


def attention(queries, keys, values, cache, scale: float, mask, sinks=None) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`, run per group of rows where the cache planned
    groups for this forward (RaggedKVCache.attention_groups), else as it is."""
    groups = getattr(cache, "attention_groups", None)
    if groups is None:
        return _mlx_lm_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    T = queries.shape[2]
    out = []
    for start, stop, extent in groups:
        if cache.attends_as_lone_rows(start, stop, T):
            part = None if T == 1 else "causal"
        else:
            part = mask[start:stop, ..., :extent]
        out.append(_mlx_lm_attention(queries[start:stop], keys[start:stop, :, :extent],
                                     values[start:stop, :, :extent], cache=cache, scale=scale,
                                     mask=part, sinks=sinks))
    return mx.concatenate(out, axis=0)


def install() -> None:
    """Route mlx-lm's Qwen attention (Qwen3.5 uses Qwen3-Next's class) through `attention`;
    other caches than RaggedKVCache never plan groups, so nothing else changes."""
    # The model file imports the function by name: patched where it is looked up.
    for module in patched_modules("attention"):
        module.scaled_dot_product_attention = attention
