"""Failures that belong to one request, and the cache snapshot that undoes a failed cycle.

A request brings its own code into the engine's step: logits processors, a sampler, a
detokenizer. When that code raises while a cycle's graph is being built, only that
request must fail; the others go on with their caches and output unchanged. `blame`
tags such an exception with the request, and `CycleSnapshot` restores what building
the cycle had changed (cache lengths, Gated DeltaNet state references, seeded random
keys), so the cycle can be rebuilt without the failed row. An error that cannot be
attributed (one raised while the device evaluates a whole batch) still propagates to
the caller, which rebuilds the engine.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional

from ..mlxlm.model_cache import ModelCache


class RowFailure(Exception):
    """An exception raised by one request's own work (processors, sampling, output)."""

    def __init__(self, request_id: int, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_id = request_id
        self.cause = cause


@contextlib.contextmanager
def blame(request_id: int):
    """Re-raise any exception of the block as a RowFailure of `request_id`."""
    try:
        yield
    except RowFailure:
        raise
    except Exception as e:  # noqa: BLE001 - whatever it is, it is this request's
        raise RowFailure(request_id, e) from e


class CycleSnapshot:
    """What building one decode cycle changes, taken before it: restoring it undoes the
    build (nothing has been read from the device yet). The caches' part is theirs
    (ModelCache.snapshot); samplers advance their keys (and reproducible ones their positions)."""

    def __init__(self, caches: List[Optional[ModelCache]], samplers: list):
        self._caches = [(c, c.snapshot()) for c in caches if c is not None]
        self._keys = [(s, s.key, s.position) for s in samplers]

    def restore(self) -> None:
        for cache, snapshot in self._caches:
            cache.restore(snapshot)
        for sampler, key, position in self._keys:
            sampler.key, sampler.position = key, position
