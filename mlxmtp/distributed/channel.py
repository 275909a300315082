"""Rank 0 tells the other ranks things: small messages over the group's collectives.

A message is JSON, broadcast as an `all_sum` in which the other ranks add zeros (MLX has
no broadcast; mlx-lm's server shares its requests the same way). Most messages (an
idle step, a depth) fit one fixed frame; a longer one takes a second collective.
Collectives run on the CPU stream: they are tiny, and a GPU would only add a copy.
"""

from __future__ import annotations

import json
import time
from typing import Any, List, Optional

import mlx.core as mx
import numpy as np

FRAME = 256  # bytes of the first collective of every message: 4 of length, the rest payload
_INLINE = FRAME - 4


class Channel:
    def __init__(self, group):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.bytes_sent = 0  # payload bytes shared so far (bench/distributed.py reports them)
        self.messages = 0
        self.seconds = 0.0  # spent in these collectives, waiting for the other ranks included

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _sum(self, buf: np.ndarray) -> np.ndarray:
        t = time.perf_counter()
        out = np.array(mx.distributed.all_sum(mx.array(buf), group=self.group, stream=mx.cpu))
        self.seconds += time.perf_counter() - t
        return out

    def share_bytes(self, data: Optional[bytes]) -> bytes:
        """Rank 0's `data` on every rank (the others pass None)."""
        frame = np.zeros(FRAME, np.uint8)
        if self.leader:
            frame[:4] = np.frombuffer(len(data).to_bytes(4, "little"), np.uint8)
            head = np.frombuffer(data[:_INLINE], np.uint8)
            frame[4 : 4 + head.size] = head
        frame = self._sum(frame)
        n = int.from_bytes(frame[:4].tobytes(), "little")
        self.messages += 1
        self.bytes_sent += n
        if n <= _INLINE:
            return frame[4 : 4 + n].tobytes()
        rest = np.zeros(n - _INLINE, np.uint8)
        if self.leader:
            rest[:] = np.frombuffer(data[_INLINE:], np.uint8)
        return frame[4:].tobytes() + self._sum(rest).tobytes()

    def share(self, obj: Any = None) -> Any:
        """Rank 0's JSON-able `obj` on every rank."""
        data = json.dumps(obj, separators=(",", ":")).encode() if self.leader else None
        return json.loads(self.share_bytes(data))

    def share_ints(self, values: Optional[List[int]], n: int) -> List[int]:
        """Rank 0's `n` integers on every rank, in one small collective."""
        buf = np.zeros(n, np.int64)
        if self.leader:
            buf[:] = values
        self.messages += 1
        return [int(v) for v in self._sum(buf)]

    def share_floats(self, values: Optional[List[float]], n: int) -> List[float]:
        """Rank 0's `n` floats (NaN passes) on every rank, rank 0 included, in one small
        collective; float32 (MLX's), so every rank gets exactly the same numbers."""
        buf = np.zeros(n, np.float32)
        if self.leader:
            buf[:] = values
        self.messages += 1
        return [float(v) for v in self._sum(buf)]

    def gather_bytes(self, data: bytes, n: int) -> List[bytes]:
        """Every rank's `n` bytes, in rank order, on every rank (start-up checks)."""
        out = mx.distributed.all_gather(mx.array(np.frombuffer(data[:n].ljust(n, b"\0"), np.uint8)),
                                        group=self.group, stream=mx.cpu)
        flat = np.array(out).tobytes()
        return [flat[i * n : (i + 1) * n] for i in range(self.size)]
