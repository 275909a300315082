"""The caches of one model (its backbone, or the MTP head), and every operation on them.

A `ModelCache` is the list of per-layer caches mlx-lm's model forward takes (a list
subclass, so the forward takes it unchanged): a RaggedKVCache per attention layer, mlx-lm's
ArraysCache (conv state, recurrent state) per Gated DeltaNet layer. Its methods are all
the engine does with a model's state: rolling a verify back (`commit`), batching rows
(`extract_row`, `extend_rows`, `filter_rows`), undoing a cycle's build (`snapshot` /
`restore`), sizing it, and laying it out in files (`to_state` / `from_state`, after
mlx-lm's `state` / `meta_state`: the arrays, and what rebuilds the layers around them).
No module above this package reads a layer's fields.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from .ragged_cache import RaggedKVCache


class ModelCache(list):
    """A model's per-layer caches (see the module docstring)."""

    # --- the layers by kind -------------------------------------------------------------
    def attention(self) -> List[RaggedKVCache]:
        return [c for c in self if isinstance(c, RaggedKVCache)]

    def gdn(self) -> List[ArraysCache]:
        return [c for c in self if isinstance(c, ArraysCache)]

    def fix_shapes(self, from_tokens: int) -> None:
        """Forwards of `from_tokens` or more tokens see whole, masked attention buffers
        (RaggedKVCache's shape-stable mode): their shapes never depend on positions."""
        for c in self.attention():
            c.fixed_shape_from = from_tokens

    # --- rollback -----------------------------------------------------------------------
    def commit(self, records: list, kept: Sequence[int], verified: int) -> None:
        """Roll every layer back to the state after `kept[b]` of the `verified` tokens of row b.

        Attention: trim each row's end. Gated DeltaNet: the conv state is a slice of the
        recorded conv window; the recurrent state is the one the verify recorded at the kept
        position, or replayed from the state before the verify over the kept positions
        (gdn_capture.LayerRecord.state_after), so no second forward of the model is needed.
        """
        trims = [verified - n for n in kept]
        if not any(trims):
            return  # the forward already left every layer at its final state
        self.trim_rows(trims)
        gdn = self.gdn()
        assert len(gdn) == len(records), "recorded Gated DeltaNet layers do not match the cache"
        if len(kept) == 1:  # one row: the conv state is a plain slice
            for c, rec in zip(gdn, records):
                n = kept[0]
                c[0] = rec.conv_input[:, n : n + rec.conv_input.shape[1] - verified]
                c[1] = rec.state_after(kept)
            return
        _roll_back_gdn(gdn, records, mx.array(kept), kept, verified)

    def commit_unread(self, records: list, consumed: mx.array, verified: int) -> None:
        """`commit` for a cycle not read yet: consumed [B] int32 on the device. Attention
        caches defer their trims (settled by `settle` once read); Gated DeltaNet states are
        rebuilt from the array, selected or replayed (shape-stable caches only)."""
        self.defer_trim(verified - consumed)
        _roll_back_gdn(self.gdn(), records, consumed, consumed, verified)

    def trim_rows(self, counts: Sequence[int]) -> None:
        """Every attention layer's row b back by counts[b] positions."""
        for c in self.attention():
            c.trim_rows(counts)

    def defer_trim(self, counts: mx.array) -> None:
        """`trim_rows` by counts [B] still on the device (settled by `settle`)."""
        for c in self.attention():
            c.defer_trim(counts)

    def settle(self, trims: Sequence[int]) -> None:
        """The oldest deferred trim of every attention layer, now known on the host."""
        for c in self.attention():
            c.settle_trim(list(trims))

    def snapshot(self) -> list:
        """What building a cycle changes (see `restore`): the attention layers' ends, settled
        or deferred (slots past an end are overwritten by the next write), and the Gated
        DeltaNet layers' state arrays (immutable: their references are enough)."""
        return [(list(c.lengths), list(c.deferred)) if isinstance(c, RaggedKVCache) else list(c.cache)
                for c in self]

    def restore(self, snapshot: list) -> None:
        """Every layer as it was at `snapshot` (nothing read from the device since)."""
        for c, s in zip(self, snapshot):
            if isinstance(c, RaggedKVCache):
                c.lengths, c.deferred = list(s[0]), list(s[1])
            else:
                c.cache = list(s)

    # --- rows -----------------------------------------------------------------------------
    def filter_rows(self, rows: List[int]) -> None:
        for c in self:
            c.filter(rows)

    def extend_rows(self, other: "ModelCache") -> None:
        """Append other's rows after this cache's."""
        for c, o in zip(self, other):
            c.extend(o)

    def extract_row(self, row: int) -> "ModelCache":
        """Row `row` as a cache of its own (views of this one's arrays)."""
        out = ModelCache()
        for c in self:
            if isinstance(c, RaggedKVCache):
                out.append(c.extract(row))
            else:
                out.append(_arrays_cache([None if a is None else a[row : row + 1] for a in c.cache]))
        return out

    def copy(self) -> "ModelCache":
        """A shallow copy: arrays are immutable, so sharing them is safe and free."""
        return ModelCache(c.copy() if isinstance(c, RaggedKVCache) else _arrays_cache(list(c.cache))
                          for c in self)

    def owned_copy(self) -> "ModelCache":
        """A copy whose arrays hold only their own data (evaluate them to drop the sources).

        An MLX slice is a view: it keeps its whole source buffer alive. One row of a batch
        cache (`extract_row`) would keep every row's KV at the buffer's full capacity, and
        every row's Gated DeltaNet state. `mx.contiguous` copies a view that covers part of
        its buffer and shares an array that is its whole buffer."""
        out = self.copy()
        for c in out:
            if isinstance(c, RaggedKVCache):
                if c.keys is not None:
                    c.keys, c.values = mx.contiguous(c.keys), mx.contiguous(c.values)
            else:
                c.cache = [None if a is None else mx.contiguous(a) for a in c.cache]
        return out

    # --- sizes --------------------------------------------------------------------------
    def arrays(self) -> List[mx.array]:
        """Every array the cache holds (what to evaluate so its state is materialised)."""
        out = []
        for c in self:
            if isinstance(c, RaggedKVCache):
                if c.keys is not None:
                    out += [c.keys, c.values]
            else:
                out += [a for a in c.cache if a is not None]
        return out

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self)

    def footprint(self) -> Tuple[int, int]:
        """(bytes per position of one row: its attention KV, bytes of one row that do not
        grow with positions: its Gated DeltaNet state), for a cache of one row that has
        seen a forward (its buffers exist)."""
        per_position = per_row = 0
        for c in self:
            if isinstance(c, RaggedKVCache):
                per_position += (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2]
            else:
                per_row += sum(a.nbytes for a in c.cache if a is not None)
        return per_position, per_row

    # --- the compiled head's step (engine/compiled_head.py) -------------------------------
    def shape_stable(self, T: int) -> bool:
        """Whether every layer is attention with a buffer, whole for a forward of T tokens."""
        return bool(self) and all(isinstance(c, RaggedKVCache) and c.keys is not None and c.fixed_shape(T)
                                  for c in self)

    def buffers(self, T: int) -> Tuple[List[mx.array], List[mx.array]]:
        """(each layer's row ends, each layer's keys and values buffers) for a step of T
        tokens written at the ends: the buffers grown for them first."""
        for c in self:
            c.reserve(T)
        return [c.ends() for c in self], [x for c in self for x in (c.keys, c.values)]

    def take_buffers(self, kv: List[mx.array], T: int) -> None:
        """The buffers such a step returned (`buffers`' order), its T tokens written."""
        for i, c in enumerate(self):
            c.keys, c.values = kv[2 * i], kv[2 * i + 1]
            c.lengths = [n + T for n in c.lengths]

    # --- files ------------------------------------------------------------------------------
    def to_state(self, prefix: str) -> Tuple[Dict[str, mx.array], list]:
        """(its arrays by name under `prefix`: mlx-lm's `state`; each layer as ["kv", length]
        or ["gdn", slots]: mlx-lm's `meta_state`) of a cache of one row."""
        arrays: Dict[str, mx.array] = {}
        meta = []
        for i, c in enumerate(self):
            if isinstance(c, RaggedKVCache):
                meta.append(["kv", c.lengths[0]])
                if c.keys is not None:
                    arrays[f"{prefix}.{i}.keys"], arrays[f"{prefix}.{i}.values"] = c.keys, c.values
            else:
                meta.append(["gdn", len(c.cache)])
                for j, a in enumerate(c.cache):
                    if a is not None:
                        arrays[f"{prefix}.{i}.{j}"] = a
        return arrays, meta

    def from_state(self, meta: list, prefix: str, arrays: Dict[str, mx.array]) -> "ModelCache":
        """The cache `to_state` gave (`meta`, and `arrays` by name), its layers checked one by
        one against this one's (the running model's): ValueError where they differ."""
        if len(meta) != len(self):
            raise ValueError(f"{len(meta)} layers stored, the model has {len(self)}")
        out = ModelCache()
        for i, ((kind, size), fresh) in enumerate(zip(meta, self)):
            if kind == "kv" and isinstance(fresh, RaggedKVCache):
                out.append(_kv_layer(int(size), arrays, f"{prefix}.{i}"))
            elif kind == "gdn" and isinstance(fresh, ArraysCache) and size == len(fresh.cache):
                out.append(_arrays_cache([arrays.get(f"{prefix}.{i}.{j}") for j in range(size)]))
            else:
                raise ValueError(f"layer {i} stored as {kind}, the model's is {type(fresh).__name__}")
        return out

    @staticmethod
    def position_axis(name: str) -> Optional[int]:
        """The axis of the array `name` (of `to_state`) whose length is the row's positions."""
        return 2 if name.endswith((".keys", ".values")) else None


def _kv_layer(size: int, arrays: Dict[str, mx.array], name: str) -> RaggedKVCache:
    c = RaggedKVCache(1)
    c.lengths = [size]
    if size:
        c.keys, c.values = arrays[f"{name}.keys"], arrays[f"{name}.values"]
        if any(a.shape[0] != 1 or a.shape[2] != size for a in (c.keys, c.values)):
            layer = name.rpartition(".")[2]
            raise ValueError(f"layer {layer}: keys / values of shapes {c.keys.shape} / {c.values.shape} for "
                             f"{size} positions")
    return c


def _arrays_cache(arrays: list) -> ArraysCache:
    c = ArraysCache(len(arrays))
    c.cache = arrays
    return c


def _roll_back_gdn(gdn: list, records: list, consumed: mx.array, kept, verified: int) -> None:
    """Each Gated DeltaNet layer to its state after consumed[b] ([B] array) of the verified
    tokens of row b: the conv window's slice, and the recurrent state at the kept positions,
    recorded or replayed (`kept`: the same counts as host ints, or the array itself)."""
    for c, rec in zip(gdn, records):
        n_keep = rec.conv_input.shape[1] - verified
        pos = (consumed[:, None] + mx.arange(n_keep))[..., None]
        c[0] = mx.take_along_axis(rec.conv_input, pos, axis=1)
        c[1] = rec.state_after(kept)
