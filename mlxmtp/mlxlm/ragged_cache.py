"""Attention KV cache where every row has its own length.

mlx-lm's `BatchKVCache` is left-padded and trims all rows alike; re-aligning rows
after ragged acceptance moves every row's whole buffer (tens of ms at 512 context,
~1 s at 4096 on a CPU). Here a row's end is just an integer, so trimming any row
is O(1), and rows write at their own ends with one scatter.

With one row, or rows of equal length, it behaves exactly like mlx-lm's `KVCache`
(same slicing, same "causal"/None masks, same integer RoPE offset), so B=1 decoding
is numerically the same as stock mlx-lm.

Shape-stable mode (`fixed_shape_from = T`): a forward of T or more query tokens gets the
whole buffer (its capacity, a multiple of `step`) and an explicit mask over it, so the
arrays of a verify depend on (batch size, tokens, capacity) and never on the rows'
lengths. A GPU backend that plans or compiles a kernel per shape (masked multi-token
attention) then pays once per capacity bucket, not once per position. The engine sets
it on its decode caches for verify forwards (T >= 2) and for the head (all T); plain
decoding (T = 1) keeps mlx-lm's exact slices.

Rows of very different lengths: each forward plans runs of rows whose attention reads
only their own extent of the buffers (`attention_groups`, see row_attention.py); then
update_and_fetch hands over the whole buffer and the attention cuts each run's part.

Deferred trims (`defer_trim` / `settle_trim`): a trim whose per-row counts are still on the
device (a cycle built before the previous one was read). Until it is settled, `lengths`
are upper bounds (what capacity is sized by) and the true ends are `lengths` minus the
deferred counts, as an array: writes scatter there and masks are built from it. Only in
shape-stable forwards, whose shapes never depend on the ends.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask as _kv_mask

from .row_attention import plan_groups


class RaggedKVCache:
    step = 256

    def __init__(self, batch_size: int = 1):
        self.keys: Optional[mx.array] = None  # [B, H, capacity, D]
        self.values: Optional[mx.array] = None
        self.lengths: List[int] = [0] * batch_size
        self.fixed_shape_from: Optional[int] = None  # see the module docstring
        self.deferred: List[mx.array] = []  # [B] int32 trims not yet known on the host, oldest first
        # Runs of rows the last forward's attention reads apart, or None (row_attention.py).
        self.attention_groups = None

    # --- what mlx-lm's attention layers use -------------------------------------------
    @property
    def uniform(self) -> bool:
        return not self.deferred and all(n == self.lengths[0] for n in self.lengths)

    def ends(self) -> mx.array:
        """[B] int32: each row's end, deferred trims included."""
        out = mx.array(self.lengths, dtype=mx.int32)
        for t in self.deferred:
            out = out - t
        return out

    @property
    def offset(self):
        """RoPE offset: an int when rows agree (as KVCache), else one per row."""
        return self.lengths[0] if self.uniform else self.ends()

    def _grow(self, keys: mx.array, values: mx.array, needed: int) -> None:
        B, H, _, Dk = keys.shape
        Dv = values.shape[3]
        cap = 0 if self.keys is None else self.keys.shape[2]
        if needed <= cap:
            return
        new_cap = self._whole_steps(needed)
        k = mx.zeros((B, H, new_cap - cap, Dk), keys.dtype)
        v = mx.zeros((B, H, new_cap - cap, Dv), values.dtype)
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = mx.concatenate([self.keys, k], axis=2)
            self.values = mx.concatenate([self.values, v], axis=2)

    def _whole_steps(self, positions: int) -> int:
        """The capacity that holds `positions`: buffers grow (and are cut) in whole steps."""
        return -(-positions // self.step) * self.step

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        T = keys.shape[2]
        self._grow(keys, values, max(self.lengths) + T)
        if self.uniform:
            n = self.lengths[0]
            self.keys[..., n : n + T, :] = keys
            self.values[..., n : n + T, :] = values
        else:
            ends = self.ends()
            self.keys, self.values = write_at_ends(self.keys, ends, keys), write_at_ends(self.values, ends, values)
        self.lengths = [n + T for n in self.lengths]
        self.attention_groups = self._plan_groups(T)
        if self.fixed_shape(T) or self.attention_groups is not None:
            return self.keys, self.values  # row_attention cuts each group's extent
        end = max(self.lengths)
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _plan_groups(self, T: int):
        """Runs of rows to attend apart in this forward (row_attention.plan_groups), from the
        rows' lengths once its T tokens are written: their capacity buckets in shape-stable
        mode (upper bounds while trims are deferred: the mask cuts the rest)."""
        if len(self.lengths) < 2:
            return None
        if self.fixed_shape(T):
            return plan_groups(tuple(self._whole_steps(n) for n in self.lengths))
        return plan_groups(tuple(self.lengths))

    def attends_as_lone_rows(self, start: int, stop: int, T: int) -> bool:
        """Whether rows [start, stop) of the last forward attend as a lone row would: all of
        one length and sliced to it (no mask for one token, "causal" for several)."""
        return not self.fixed_shape(T) and len(set(self.lengths[start:stop])) == 1

    def query_bucket(self, N: int, width: int = 0) -> int:
        """How many query tokens a forward of N should be padded to: N; in shape-stable mode
        `width` when N fits in it (a head pass padded to the verify's width shares the
        verify's shapes), else the next power of two (a long catch-up takes one of a few)."""
        if not self.fixed_shape(N):
            return N
        return width if N <= width else 1 << (N - 1).bit_length()

    def fixed_shape(self, N: int) -> bool:
        """Whether a forward of N query tokens gets the whole buffer (shape-stable mode)."""
        return self.fixed_shape_from is not None and N >= self.fixed_shape_from

    def reserve(self, N: int) -> None:
        """Grow the buffer now for N more tokens per row, as update_and_fetch would (a
        compiled step takes the buffer at its final shape)."""
        if self.keys is not None:
            self._grow(self.keys, self.values, max(self.lengths) + N)

    def _capacity_for(self, N: int) -> int:
        """The buffer's capacity once N more tokens are written (what _grow makes it)."""
        cap = 0 if self.keys is None else self.keys.shape[2]
        needed = max(self.lengths) + N
        return cap if needed <= cap else self._whole_steps(needed)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if self.fixed_shape(N):
            return mask_from_ends(self.ends(), N, self._capacity_for(N))  # over the whole buffer
        assert not self.deferred, "deferred trims need shape-stable forwards"
        if self.uniform:
            # Exactly what mlx-lm's KVCache.make_mask returns.
            return _kv_mask(N, self.lengths[0], return_array, window_size)
        # Slots beyond a row's end are stale.
        return mask_from_ends(mx.array(self.lengths), N, max(self.lengths) + N)

    # --- speculative decoding ---------------------------------------------------------
    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        self.lengths = [max(0, m - n) for m in self.lengths]
        return n

    def trim_rows(self, counts: List[int]) -> None:
        self.lengths = [max(0, m - c) for m, c in zip(self.lengths, counts)]

    def defer_trim(self, counts: mx.array) -> None:
        """Trim row b by counts[b] ([B] int32 on the device), known on the host later."""
        assert self.fixed_shape_from is not None, "deferred trims need shape-stable forwards"
        self.deferred.append(counts)

    def settle_trim(self, counts: List[int]) -> None:
        """The oldest deferred trim's counts, now read on the host."""
        self.deferred.pop(0)
        self.trim_rows(counts)

    # --- batching ---------------------------------------------------------------------
    def filter(self, rows: List[int]) -> None:
        """Keep `rows`, in buffers cut to the capacity they need. A row that leaves may
        have been the longest: the others must not go on holding (and, in shape-stable
        forwards, attending over) its capacity for as long as the batch runs."""
        idx = mx.array(rows)
        self.lengths = [self.lengths[r] for r in rows]  # upper bounds while trims are deferred
        if self.keys is not None:
            cap = max(self.step, self._whole_steps(max(self.lengths, default=0)))
            cap = min(cap, self.keys.shape[2])
            # Cut, then gather: the new buffers are the kept rows at `cap`, nothing more.
            self.keys = mx.take(self.keys[:, :, :cap], idx, axis=0)
            self.values = mx.take(self.values[:, :, :cap], idx, axis=0)
        self.deferred = [t[idx] for t in self.deferred]

    def extend(self, other: "RaggedKVCache") -> None:
        """Append other's rows; an empty side gets zero rows (its lengths say they are unused)."""
        assert not self.deferred and not other.deferred, "settle deferred trims first"
        if self.keys is None and other.keys is None:
            self.lengths = self.lengths + other.lengths
            return
        ref = self.keys if self.keys is not None else other.keys
        ref_v = self.values if self.values is not None else other.values

        def rows(c, x, like):
            if x is None:
                return mx.zeros((len(c.lengths),) + like.shape[1:], like.dtype)
            return x

        mine = (rows(self, self.keys, ref), rows(self, self.values, ref_v))
        theirs = (rows(other, other.keys, ref), rows(other, other.values, ref_v))
        a, b = mine[0].shape[2], theirs[0].shape[2]
        if a < b:
            mine = tuple(_pad_time(x, b) for x in mine)
        elif b < a:
            theirs = tuple(_pad_time(x, a) for x in theirs)
        self.keys = mx.concatenate([mine[0], theirs[0]])
        self.values = mx.concatenate([mine[1], theirs[1]])
        self.lengths = self.lengths + other.lengths

    def extract(self, row: int) -> "RaggedKVCache":
        """One row as its own cache, sliced to its length (a prefix-cache snapshot)."""
        assert not self.deferred, "settle deferred trims first"
        c = RaggedKVCache(1)
        n = self.lengths[row]
        if self.keys is not None and n > 0:
            c.keys = self.keys[row : row + 1, :, :n, :]
            c.values = self.values[row : row + 1, :, :n, :]
        c.lengths = [n]
        return c

    def copy(self) -> "RaggedKVCache":
        """An independent cache sharing the data: `update_and_fetch` assigns into its
        arrays in place, so the copy must hold new array objects (slices), never the same ones."""
        assert not self.deferred, "settle deferred trims first"
        c = RaggedKVCache(len(self.lengths))
        c.lengths = list(self.lengths)
        c.fixed_shape_from = self.fixed_shape_from
        if self.keys is not None:
            n = max(self.lengths)
            c.keys, c.values = self.keys[:, :, :n], self.values[:, :, :n]
        return c

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def empty(self) -> bool:
        return self.keys is None


def write_at_ends(buffer: mx.array, ends: mx.array, new: mx.array) -> mx.array:
    """buffer [B, H, capacity, D] with new [B, H, T, D] written at row b's positions
    ends[b] .. ends[b] + T - 1 (ends [B] int32)."""
    B, H, T, D = new.shape
    pos = (ends[:, None] + mx.arange(T))[:, None, :, None]
    return mx.put_along_axis(buffer, mx.broadcast_to(pos, (B, H, T, D)), new, axis=2)


def mask_from_ends(ends: mx.array, N: int, width: int) -> mx.array:
    """[B, 1, N, width] bool: row b's query t sees keys [0, ends[b] + t] (ends [B]: each
    row's length before the N queries)."""
    limit = ends[:, None, None, None] + mx.arange(N)[None, None, :, None]
    return mx.arange(width)[None, None, None, :] <= limit


def _pad_time(x: mx.array, cap: int) -> mx.array:
    pad = mx.zeros(x.shape[:2] + (cap - x.shape[2],) + x.shape[3:], x.dtype)
    return mx.concatenate([x, pad], axis=2)
