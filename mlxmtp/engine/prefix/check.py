"""What a prefix cache state read from disk must pass to be used (engine/prefix/disk.py).

A state is restored only if it is exactly what the server wrote, and of the running model:

- Its index (the JSON) carries a checksum of its own text, and for every array of the
  entry its shape, dtype and the xxh3-64 of its bytes (several GB/s on one core: a small
  part of reading the file). A file cut short, bytes changed on the disk or by a copy, an
  index naming other arrays than the file holds: each fails.
- Every array's shape and dtype are those of the running model's state (`model_state`),
  apart from the positions an attention layer holds and how many head inputs are pending.
  A state of another model, or one whose index was made to agree with its arrays, fails
  here (it would otherwise fail inside the forward, on every request sharing its prefix).

A state that fails is a miss: the prompt is prefilled as without it.
"""

from __future__ import annotations

import json
from typing import Dict, Optional, Tuple

import mlx.core as mx
import xxhash

from ...mlxlm import adapter
from ...mlxlm.model_cache import ModelCache
from . import files as prefix_files
from .cache import PrefixEntry

Shapes = Dict[str, Tuple[Tuple[Optional[int], ...], mx.Dtype, bool]]  # see `shapes_of`


def checksum(a: mx.array) -> str:
    """xxh3-64 of the array's bytes, row-major (evaluates it)."""
    return xxhash.xxh3_64_hexdigest(memoryview(mx.contiguous(a)))


def describe(arrays: Dict[str, mx.array]) -> Dict[str, list]:
    """What the index records of each array: [shape, dtype, checksum]."""
    return {name: [list(a.shape), str(a.dtype), checksum(a)] for name, a in arrays.items()}


def verify(arrays: Dict[str, mx.array], described: Dict[str, list]) -> None:
    """Raise ValueError unless `arrays` are exactly those `described` (by `describe`)."""
    if set(arrays) != set(described):
        raise ValueError("the file holds other arrays than its index names")
    for name, a in arrays.items():
        if described[name] != [list(a.shape), str(a.dtype), checksum(a)]:
            raise ValueError(f"{name} is not the array that was written")


def seal(meta: dict) -> str:
    """The index's text, with the checksum of the rest of it."""
    body = {k: v for k, v in meta.items() if k != "check"}
    return json.dumps({**body, "check": _text_checksum(body)})


def unseal(text: str) -> dict:
    """The index `seal` wrote; ValueError if it is not what was written."""
    meta = json.loads(text)
    if not isinstance(meta, dict) or meta.get("check") != _text_checksum({k: v for k, v in meta.items() if k != "check"}):
        raise ValueError("the index is not what was written")
    return meta


def index_of(text: str, name: str) -> dict:
    """The index of the entry `name` (prefix_files.entry_name); ValueError if it is not
    what `seal` wrote, of another format, or of other tokens than `name` is made from."""
    meta = unseal(text)
    if meta.get("format") != prefix_files.FORMAT or prefix_files.entry_name(meta["tokens"]) != name:
        raise ValueError("an index of another format, or of other tokens")
    return meta


def _text_checksum(body: dict) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True).encode())


def model_state(pieces) -> PrefixEntry:
    """The running model's state after one token, never evaluated (mlx builds the graph
    and knows every shape and dtype without computing anything): what a stored state of
    this model looks like, apart from its length. The head's cache comes from the head
    itself, which may compute in a wider dtype than the model."""
    cache = adapter.make_cache(pieces.parts, 1)
    token = mx.array([[0]])
    logits, hidden = adapter.forward(pieces.parts, token, cache, pieces.hidden_state)
    head_cache = None
    if pieces.head is not None:
        head_cache = adapter.make_head_cache(pieces.head, 1)
        pieces.head(pieces.vocab.embed_tokens(token), hidden, head_cache)
    return PrefixEntry((0,), cache, head_cache, hidden[0], [], logits[0, -1], 0)


def shapes_of(state: PrefixEntry) -> Shapes:
    """Each array a stored state of the model `state` comes from may hold, by its name in
    the file: (shape, None on the axis whose length varies; dtype; whether every state
    holds it: a Gated DeltaNet layer's slots, which a state without would silently run
    from zeros)."""
    arrays, _ = prefix_files.flatten(state)
    out = {}
    for name, a in arrays.items():
        free = 0 if name == "pend_h" else ModelCache.position_axis(name)
        shape = tuple(None if i == free else n for i, n in enumerate(a.shape))
        out[name] = (shape, a.dtype, free is None and name != "last_logits")
    return out


def check_fits(arrays: Dict[str, mx.array], shapes: Shapes) -> None:
    """Raise ValueError unless `arrays` (a state's, by name) fit the model's `shapes`."""
    missing = sorted(name for name, (_, _, always) in shapes.items() if always and name not in arrays)
    if missing:
        raise ValueError(f"no {missing[0]}, which the model's state holds")
    for name, a in arrays.items():
        if name not in shapes:
            raise ValueError(f"{name}: the model's state has no such array")
        shape, dtype, _ = shapes[name]
        if a.dtype != dtype or len(a.shape) != len(shape) or any(n not in (None, m) for n, m in zip(shape, a.shape)):
            raise ValueError(f"{name} is {a.dtype} {tuple(a.shape)}, the model's is {dtype} {shape}")
