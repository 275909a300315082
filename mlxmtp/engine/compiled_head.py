"""The MTP head's forward as one compiled graph, for shape-stable head caches.

A head step (a drafting cycle's head pass, then each chained draft) is small: one
decoder layer, a few norms and a projection. Built op by op, its graph costs host time
every step, and on a GPU each of its many elementwise ops is a kernel launch.
`mx.compile` traces it once per shape and fuses the elementwise runs, but a compiled
function must be pure and its shapes must not change with every position: mlx-lm's KV
cache writes at a Python-integer offset and slices to the row's length, which would make
a new trace per position.

So the compiled function gets the cache's whole buffer (RaggedKVCache's shape-stable
mode: its shape depends only on the capacity bucket) and each row's end as array values:
it writes the new keys there, masks by the ends, and returns the new buffers. A head
step then traces once per (batch size, query width, capacity bucket), the same set of
shapes the uncompiled shape-stable path uses. Anything else (a sliced cache, an empty
one) runs the head as it is.

mlx-lm compiles no model forward (its models are called with varying caches); this is
written here for the head's fixed-shape steps only.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

from ..mlxlm.model_cache import ModelCache
from ..mlxlm.ragged_cache import mask_from_ends, write_at_ends
from ..models.mtp_head import MTPHead


class _BufferCache:
    """What mlx-lm's attention layer uses of a cache, inside the traced function: the
    RoPE offset (each row's end) and a write at the ends that returns the whole buffer."""

    def __init__(self, keys: mx.array, values: mx.array, ends: mx.array):
        self.keys, self.values, self.offset = keys, values, ends

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys = write_at_ends(self.keys, self.offset, keys)
        self.values = write_at_ends(self.values, self.offset, values)
        return self.keys, self.values


class CompiledHead:
    """An MTPHead called as `head(embeddings, hidden, cache)`, compiled where the cache is
    shape-stable for the step's query count (see the module docstring), else as it is."""

    def __init__(self, head: MTPHead):
        self.head = head
        self._step = mx.compile(self._pure_step)

    @property
    def layers(self):
        return self.head.layers

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: Optional[ModelCache] = None,
                 mask=None) -> mx.array:
        T = embeddings.shape[1]
        if mask is not None or cache is None or not cache.shape_stable(T):
            return self.head(embeddings, hidden, cache, mask)
        ends, kv = cache.buffers(T)
        out, new_kv = self._step(embeddings, hidden, ends, kv)
        cache.take_buffers(new_kv, T)
        return out

    def _pure_step(self, embeddings: mx.array, hidden: mx.array, ends: List[mx.array], kv: List[mx.array]):
        caches = [_BufferCache(kv[2 * i], kv[2 * i + 1], e) for i, e in enumerate(ends)]
        # Over the whole buffer, as RaggedKVCache.make_mask in shape-stable mode.
        mask = mask_from_ends(ends[0], embeddings.shape[1], kv[0].shape[2])
        out = self.head(embeddings, hidden, caches, mask)
        return out, [x for c in caches for x in (c.keys, c.values)]

