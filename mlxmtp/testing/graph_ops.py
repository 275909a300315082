"""Count the operations MLX evaluates: what a decode step launches on a GPU.

On a GPU each operation MLX evaluates is one kernel launch (a run of elementwise ops
that `mx.compile` fused is one), encoded by the host as it evaluates. For a small model
those launches and the host work around them are much of a decode step's cost, so the
operations per generated token measure that part of it deterministically, on any
backend: two ways of decoding the same tokens compare exactly, with none of a timing's
noise. (What each operation costs on the device is another matter: see
scripts/gpu_op_probe.py.)

`OpCounter` wraps MLX's evaluation entry points while it is active (`mx.eval`,
`mx.async_eval`, and the reads that evaluate: `item`, `tolist`, `int`, `float`, `bool`).
Before each evaluation it exports the graph of the arrays not yet evaluated
(`mx.export_to_dot`, which stops at evaluated arrays, so nothing counts twice) and counts
its nodes by primitive. Views (reshape, slice, broadcast, transpose, ...) are kept apart:
they move no data. On the CPU the `mx.fast` ops (rms_norm, rope, attention) are built
from their fallback ops, where a GPU runs each as one kernel, so absolute counts here
are higher than a GPU's, alike for both sides of a comparison.

Written here because MLX exposes no counter of the kernels it launches.
"""

from __future__ import annotations

import collections
import os
import tempfile
import traceback
from typing import Counter, Optional

import mlx.core as mx

# Primitives that give a view of their input (no kernel unless a copy is forced later).
VIEWS = frozenset({"AsStrided", "Broadcast", "Depends", "ExpandDims", "Flatten", "Reshape", "Slice",
                   "Split", "Squeeze", "StopGradient", "Transpose", "Unflatten"})
_READS = ("item", "tolist", "__int__", "__float__", "__bool__")


class OpCounter:
    """`with OpCounter() as ops:` counts what MLX evaluates inside the block.

    `ops.by_primitive`: nodes per primitive name; `ops.kernels`: those that compute
    (views excluded); `ops.by_site[name]`: computing nodes per calling function (the
    function that asked for the evaluation, by name); `ops.reset()` starts again."""

    def __init__(self):
        self.by_primitive: Counter[str] = collections.Counter()
        self.by_site: Counter[str] = collections.Counter()
        self._saved = {}
        self._path = ""

    @property
    def kernels(self) -> int:
        return sum(n for name, n in self.by_primitive.items() if name not in VIEWS)

    def reset(self) -> None:
        self.by_primitive.clear()
        self.by_site.clear()

    def count(self, *arrays) -> int:
        """Count the unevaluated graph behind `arrays` (any nesting) -> its computing nodes."""
        leaves = [a for a in _flatten(arrays) if isinstance(a, mx.array)]
        if not leaves:
            return 0
        mx.export_to_dot(self._path, *leaves)
        found = 0
        with open(self._path) as f:
            for line in f:
                name = _primitive(line)
                if name is not None:
                    self.by_primitive[name] += 1
                    found += name not in VIEWS
        self.by_site[_caller()] += found
        return found

    def __enter__(self) -> "OpCounter":
        fd, self._path = tempfile.mkstemp(suffix=".dot")
        os.close(fd)
        evaluate, start = mx.eval, mx.async_eval

        def counted_eval(*args):
            self.count(args)
            return evaluate(*args)

        def counted_async_eval(*args):
            self.count(args)
            return start(*args)

        self._saved = {"eval": evaluate, "async_eval": start}
        mx.eval, mx.async_eval = counted_eval, counted_async_eval
        for name in _READS:
            self._saved[name] = read = getattr(mx.array, name)
            setattr(mx.array, name, self._counted_read(read))
        return self

    def _counted_read(self, read):
        def counted(arr, *args):
            self.count(arr)
            return read(arr, *args)
        return counted

    def __exit__(self, *exc) -> None:
        mx.eval, mx.async_eval = self._saved.pop("eval"), self._saved.pop("async_eval")
        for name, read in self._saved.items():
            setattr(mx.array, name, read)
        self._saved = {}
        os.unlink(self._path)


def _flatten(items):
    for x in items:
        if isinstance(x, (list, tuple)):
            yield from _flatten(x)
        elif isinstance(x, dict):
            yield from _flatten(list(x.values()))
        else:
            yield x


def _primitive(line: str) -> Optional[str]:
    """The primitive's name on a node line of MLX's DOT output (`[label ="Add", shape=rectangle]`)."""
    if "shape=rectangle" not in line:
        return None
    return line.split('label ="', 1)[1].split('"', 1)[0]


def _caller() -> str:
    """The name of the first function outside this module and MLX's wrappers on the stack."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if frame.filename != __file__:
            return frame.name
    return "?"
