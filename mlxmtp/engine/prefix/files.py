"""How one prefix cache entry is laid out in files (engine/prefix/disk.py keeps them).

An entry is `<name>.safetensors`, its arrays by name (written with MLX's own
`mx.save_safetensors`), and `<name>.json`: its tokens, how to rebuild its caches from the
arrays, each array's shape, dtype and checksum, the size of the arrays' file, and a
checksum of the rest of the JSON (prefix_check.py). `<name>` is the first 32 hex digits of
the SHA-256 of its tokens (`entry_name`), which a reader checks against them. Each file is
written under a temporary name (`tmp-<pid>-<name>.<ext>`) and renamed into place once
complete, the JSON last.

mlx-lm's `save_prompt_cache` / `load_prompt_cache` rebuild mlx-lm's own cache classes by
name from a flat list; an entry here holds the model's caches (laid out by
ModelCache.to_state), the MTP head's, its pending inputs and the logits after the last
token, so it has this small layout of its own.
"""

from __future__ import annotations

import hashlib
import os
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from ...mlxlm.model_cache import ModelCache
from .cache import PrefixEntry
from .folders import remove
from .trie import Tokens

# Bump when the layout below changes: the model's fingerprint, and so its folder, changes
# with it (model_fingerprint), and older files are never read.
FORMAT = 2


def entry_name(tokens: Tokens) -> str:
    """The name of the files of the entry after `tokens`."""
    return hashlib.sha256(repr(tuple(tokens)).encode()).hexdigest()[:32]


def model_fingerprint(model_dir: Path, head: bool, hidden_state: str) -> str:
    """What a stored state depends on: the model's files (names, sizes, times), whether it
    drafts with the head, which hidden state feeds the head, and the mlx / mlx-lm versions
    that computed it. Any change gives another subfolder, never a state of another model."""
    h = hashlib.sha256(f"format {FORMAT}; head {head}; hidden {hidden_state}".encode())
    for package in ("mlx", "mlx-lm"):
        h.update(f"; {package} {package_metadata.version(package)}".encode())
    model_dir = Path(model_dir)
    # Its files and those one folder down (mtp/): not deeper, where a prefix cache folder
    # placed inside the model's own would change the fingerprint with every entry.
    for path in sorted([*model_dir.glob("*"), *model_dir.glob("*/*")]):
        if path.is_file():
            st = path.stat()
            h.update(f"; {path.relative_to(model_dir)} {st.st_size} {st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


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


def _layer_layout(cache: ModelCache, prefix: str, arrays: Dict[str, mx.array]) -> list:
    """Each layer as ["kv", length] or ["gdn", slots], its arrays put in `arrays`."""
    state, meta_state = cache.to_state(prefix)
    arrays.update(state)
    return meta_state


def rebuild(tokens: Tokens, arrays: Dict[str, mx.array], meta: dict, like: List[Optional[ModelCache]],
            nbytes: int) -> PrefixEntry:
    """The entry `meta` describes, from its `arrays` (its file, read), its caches checked
    layer by layer against `like`: [cache, head cache or None] of the running model."""
    if meta.get("format") != FORMAT or tuple(meta["tokens"]) != tokens:
        raise ValueError("written by another format, or for other tokens")
    cache_like, head_like = like
    if (head_like is None) != ("head" not in meta["layers"]):
        raise ValueError("stored with the MTP head on and read with it off, or the reverse")
    cache = cache_like.from_state(meta["layers"]["cache"], "cache", arrays)
    head = head_like.from_state(meta["layers"]["head"], "head", arrays) if head_like is not None else None
    logits = arrays["last_logits"] if meta["has_logits"] else mx.zeros((0,))
    pend_h = arrays.get("pend_h")
    mx.eval(*arrays.values())
    return PrefixEntry(tokens, cache, head, pend_h, list(meta["pend_t"]), logits, nbytes, bool(meta.get("boundary")))


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
