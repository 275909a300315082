"""How one prefix cache entry is laid out in files (engine/prefix_disk.py keeps them).

An entry is `<name>.safetensors`, its arrays by name (written with MLX's own
`mx.save_safetensors`), and `<name>.json`: its tokens, how to rebuild its caches from the
arrays, and the size of the arrays' file. Each is written under a temporary name and renamed
into place once complete, the JSON last.

mlx-lm's `save_prompt_cache` / `load_prompt_cache` rebuild mlx-lm's own cache classes by
name from a flat list; an entry here holds RaggedKVCache rows, the MTP head's cache, its
pending inputs and the logits after the last token, so it has this small layout of its own.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Dict, List, Tuple

import mlx.core as mx

from ..mlxlm.ragged_cache import RaggedKVCache
from .prefix_cache import PrefixEntry
from .prefix_trie import Tokens

FORMAT = 1  # bump when the layout below changes: older files are then not read


def flatten(entry: PrefixEntry) -> Tuple[Dict[str, mx.array], dict]:
    """(the arrays by name, the JSON that says how to rebuild the entry from them)."""
    arrays: Dict[str, mx.array] = {}
    layouts = {"cache": _layer_layout(entry.cache, "cache", arrays)}
    if entry.head_cache is not None:
        layouts["head"] = _layer_layout(entry.head_cache, "head", arrays)
    if entry.pend_h is not None:
        arrays["pend_h"] = entry.pend_h
    if entry.last_logits.size > 0:
        arrays["last_logits"] = entry.last_logits
    meta = {"format": FORMAT, "tokens": list(entry.tokens), "pend_t": list(entry.pend_t), "layers": layouts,
            "nbytes": entry.nbytes, "has_logits": entry.last_logits.size > 0, "boundary": entry.boundary}
    return arrays, meta


def _layer_layout(cache: list, prefix: str, arrays: Dict[str, mx.array]) -> list:
    """Each layer as ["kv", length] or ["gdn", slots], its arrays put in `arrays`."""
    out = []
    for i, c in enumerate(cache):
        if isinstance(c, RaggedKVCache):
            out.append(["kv", c.lengths[0]])
            if c.keys is not None:
                arrays[f"{prefix}.{i}.keys"], arrays[f"{prefix}.{i}.values"] = c.keys, c.values
        else:
            out.append(["gdn", len(c.cache)])
            for j, a in enumerate(c.cache):
                if a is not None:
                    arrays[f"{prefix}.{i}.{j}"] = a
    return out


def rebuild(tokens: Tokens, arrays: Dict[str, mx.array], meta: dict, like: List[list], nbytes: int) -> PrefixEntry:
    """The entry `meta` describes, from its `arrays` (its file, read), its caches checked
    layer by layer against `like`: [cache, head cache or None] of the running model."""
    if meta.get("format") != FORMAT or tuple(meta["tokens"]) != tokens:
        raise ValueError("written by another format, or for other tokens")
    cache_like, head_like = like
    if (head_like is None) != ("head" not in meta["layers"]):
        raise ValueError("stored with the MTP head on and read with it off, or the reverse")
    cache = _layers(meta["layers"]["cache"], "cache", arrays, cache_like)
    head = _layers(meta["layers"]["head"], "head", arrays, head_like) if head_like is not None else None
    logits = arrays["last_logits"] if meta["has_logits"] else mx.zeros((0,))
    pend_h = arrays.get("pend_h")
    mx.eval(*arrays.values())
    return PrefixEntry(tokens, cache, head, pend_h, list(meta["pend_t"]), logits, nbytes, bool(meta.get("boundary")))


def _layers(layout: list, prefix: str, arrays: Dict[str, mx.array], like: list) -> list:
    """The caches of `layout`, checked layer by layer against the running model's (`like`)."""
    if len(layout) != len(like):
        raise ValueError(f"{len(layout)} layers stored, the model has {len(like)}")
    out = []
    for i, ((kind, size), fresh) in enumerate(zip(layout, like)):
        if kind == "kv" and isinstance(fresh, RaggedKVCache):
            c = RaggedKVCache(1)
            c.lengths = [int(size)]
            if size:
                c.keys, c.values = arrays[f"{prefix}.{i}.keys"], arrays[f"{prefix}.{i}.values"]
                if c.keys.shape[2] != size or c.keys.shape[0] != 1:
                    raise ValueError(f"layer {i}: keys of shape {c.keys.shape} for {size} positions")
        elif kind == "gdn" and not isinstance(fresh, RaggedKVCache) and size == len(fresh.cache):
            c = type(fresh)(size)  # mlx-lm's ArraysCache, as the model's own
            c.cache = [arrays.get(f"{prefix}.{i}.{j}") for j in range(size)]
        else:
            raise ValueError(f"layer {i} stored as {kind}, the model's is {type(fresh).__name__}")
        out.append(c)
    return out


def write_atomically(path: Path, write) -> None:
    """`write(tmp)` to a temporary file beside `path`, renamed to `path` once it is complete
    and on the disk (synced first: after a power cut a renamed file never holds what was not
    written). The temporary name keeps `path`'s suffix (mx.save_safetensors appends one)."""
    tmp = path.with_name(f"tmp-{os.getpid()}-{path.name}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise


def folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def remove(path: Path) -> None:
    try:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass
