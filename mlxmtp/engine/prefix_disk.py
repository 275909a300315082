"""Prefix cache entries kept on disk: the ones memory evicts, and those held at shutdown.

A coding agent's prompt starts with tens of thousands of tokens of system prompt and tools.
On a large model that is tens of seconds of prefill, and its state (Qwen3.5-27B: 64 KiB of
KV per token plus the Gated DeltaNet states) is what the memory budget evicts first when
several agents run, and what a restart loses. Read back from an SSD it takes well under a
second. So with a folder given (`serve --prefix-cache-dir`), the prefix cache writes an
entry here when it evicts it and when the server stops, and a prompt that starts with a
stored sequence longer than any in memory loads that state instead of prefilling it.

One entry is two files (prefix_files.py), renamed into place once complete: an entry
whose files are incomplete is deleted at start-up, one that cannot be read when loaded. The
folder holds one subfolder per model fingerprint (the model's files, the head, mlx and
mlx-lm versions): a state is only ever restored into the model that computed it, so a hit
gives the output a miss would. Least recently used files go first once the folder's budget
is reached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx

from ..mlxlm import adapter
from . import prefix_files
from .prefix_cache import PrefixEntry
from .prefix_trie import PrefixTrie, Tokens

log = logging.getLogger("mlxmtp")
MIN_FREE_BYTES = 2 << 30  # the least a write leaves free on the disk (see DiskPrefixStore._room_for)



@dataclass
class DiskEntry:
    """An entry on disk, as the index knows it (its arrays stay in the file)."""

    tokens: Tokens
    name: str
    nbytes: int  # the entry's bytes in memory once loaded
    file_bytes: int
    has_logits: bool


def model_fingerprint(model_dir: Path, head: bool, hidden_state: str) -> str:
    """What a stored state depends on: the model's files (names, sizes, times), whether it
    drafts with the head, which hidden state feeds the head, and the mlx / mlx-lm versions
    that computed it. Any change gives another subfolder, never a state of another model."""
    h = hashlib.sha256(f"format {prefix_files.FORMAT}; head {head}; hidden {hidden_state}".encode())
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


class DiskPrefixStore:
    """Entries in `folder / fingerprint`, at most `max_bytes` of files."""

    def __init__(self, folder: Path, max_bytes: int, fingerprint: str, fresh_caches: Callable[[], List[list]]):
        self.folder = Path(folder) / fingerprint
        # -> [cache, head cache or None]: empty caches of the running model, what a loaded
        # entry must match layer by layer.
        self.fresh_caches = fresh_caches
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.entries: Dict[Tokens, DiskEntry] = {}
        self.trie = PrefixTrie()
        self.bytes = 0
        self.loads = 0
        self.warned_full = False  # the disk was too full for the last write (warned once)
        self._read_index()
        self._make_room_among_models()

    # ------------------------------------------------------------------ the index
    def _read_index(self) -> None:
        """The complete entries found in the folder, oldest first; the rest deleted."""
        complete = set()
        for index in sorted(self.folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns):
            try:
                meta = json.loads(index.read_text())
                size = index.with_suffix(".safetensors").stat().st_size
                entry = DiskEntry(tuple(meta["tokens"]), index.stem, int(meta["nbytes"]), size,
                                  bool(meta["has_logits"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if size != meta.get("file_bytes"):  # cut short (a full disk, a copy that stopped)
                continue
            self._add(entry)
            complete.add(index.stem)
        for path in self.folder.iterdir():
            if path.stem not in complete:  # temporary files, arrays without their index
                prefix_files.remove(path)

    def _make_room_among_models(self) -> None:
        """Hold the whole folder to the budget: other models' subfolders (other versions of
        mlx / mlx-lm, of the model's files) count too, and leave whole, least recently used
        first, while it is over; this model's own entries then keep what the rest leave."""
        others = [(max((f.stat().st_mtime_ns for f in d.iterdir()), default=0), prefix_files.folder_size(d), d)
                  for d in self.folder.parent.iterdir() if d.is_dir() and d != self.folder]
        others.sort(key=lambda o: o[0])
        total = self.bytes + sum(size for _, size, _ in others)
        while others and total > self.max_bytes:
            _, size, folder = others.pop(0)
            log.info("prefix cache on disk: %s (another model's, or older versions') deleted to keep the "
                     "folder within its budget", folder)
            prefix_files.remove(folder)
            total -= size
        self.shrink_to(self.max_bytes - (total - self.bytes))

    def _add(self, entry: DiskEntry) -> None:
        self.entries[entry.tokens] = entry
        self.trie.insert(entry)
        self.bytes += entry.file_bytes

    def _drop(self, entry: DiskEntry) -> None:
        del self.entries[entry.tokens]
        self.trie.remove(entry.tokens)
        self.bytes -= entry.file_bytes
        for suffix in (".json", ".safetensors"):  # the index first: no entry looks complete
            prefix_files.remove(self.folder / (entry.name + suffix))

    def shrink_to(self, nbytes: int) -> None:
        """Delete least recently used entries until the files take at most `nbytes`."""
        while self.entries and self.bytes > nbytes:
            self._drop(next(iter(self.entries.values())))

    def lookup(self, tokens: Tokens) -> Optional[DiskEntry]:
        """The longest stored sequence usable for a prompt of `tokens` (a strict prefix, or
        all of it where the logits after it were stored)."""
        return self.trie.longest_usable(tokens, lambda e: e.has_logits)

    def shared_length(self, tokens: Tokens) -> int:
        return self.trie.shared_length(tokens)

    # ------------------------------------------------------------------ files
    def save(self, entry: PrefixEntry) -> None:
        """Write `entry` unless it is stored already, larger than the whole budget, or the
        disk has no room for it (see `_room_for`)."""
        if entry.tokens in self.entries or entry.nbytes > self.max_bytes or not self._room_for(entry.nbytes):
            return
        name = hashlib.sha256(repr(entry.tokens).encode()).hexdigest()[:32]
        arrays, meta = prefix_files.flatten(entry)
        data, index = self.folder / (name + ".safetensors"), self.folder / (name + ".json")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)  # another server may have cleared it
            prefix_files.write_atomically(data, lambda tmp: mx.save_safetensors(str(tmp), arrays))
            meta["file_bytes"] = file_bytes = data.stat().st_size
            prefix_files.write_atomically(index, lambda tmp: tmp.write_text(json.dumps(meta)))
        except (OSError, RuntimeError) as e:  # a full disk, say: the entry is only a saving of work
            log.warning("could not write a prefix cache entry of %d tokens to %s: %s", len(entry.tokens),
                        self.folder, e)
            prefix_files.remove(index)
            prefix_files.remove(data)
            return
        self.shrink_to(self.max_bytes - file_bytes)
        self._add(DiskEntry(entry.tokens, name, entry.nbytes, file_bytes, entry.last_logits.size > 0))

    def _room_for(self, nbytes: int) -> bool:
        """Whether `nbytes` more leave the disk with its reserve free (a twentieth of it, at
        least MIN_FREE_BYTES: the folder's budget must never be what fills the disk), once
        this store's least recently used entries have made the room, where they can."""
        usage = shutil.disk_usage(self.folder.parent)
        reserve = max(MIN_FREE_BYTES, usage.total // 20)
        short = nbytes + reserve - usage.free
        if 0 < short <= self.bytes:  # deleting its own oldest files makes the room
            self.shrink_to(self.bytes - short)
            short = nbytes + reserve - shutil.disk_usage(self.folder.parent).free
        if short > 0 and not self.warned_full:
            log.warning("prefix cache on disk: %s has no room left beside its reserve; evicted states are not "
                        "written until it has", self.folder)
        self.warned_full = short > 0
        return short <= 0

    def load(self, found: DiskEntry) -> Optional[PrefixEntry]:
        """The entry's state; None, and the entry deleted, when it cannot be read or does
        not fit the running model's caches."""
        try:
            meta = json.loads((self.folder / (found.name + ".json")).read_text())
            arrays = mx.load(str(self.folder / (found.name + ".safetensors")))
            entry = prefix_files.rebuild(found.tokens, arrays, meta, self.fresh_caches(), found.nbytes)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            log.warning("prefix cache entry %s on disk could not be read (%s): deleted", found.name, e)
            self._drop(found)
            return None
        os.utime(self.folder / (found.name + ".json"))  # most recently used, also after a restart
        self.entries[found.tokens] = self.entries.pop(found.tokens)
        self.loads += 1
        return entry


def attach(engine, folder: Path, max_bytes: int) -> DiskPrefixStore:
    """Give `engine`'s prefix cache a disk store in `folder` of at most `max_bytes`."""
    cache, pieces = engine.prefix_cache, engine.pieces
    model_dir = getattr(engine.model, "model_dir", None)
    if model_dir is None:
        raise ValueError("a prefix cache on disk needs a model loaded from a folder")
    if cache.max_bytes <= 0:
        raise ValueError("a prefix cache on disk needs one in memory (--prefix-cache-mb above 0)")
    if cache.agree is not None:  # each rank would load and evict on its own
        raise ValueError("a prefix cache on disk is not supported across ranks (mlx.launch)")

    def fresh_caches() -> List[list]:
        head = pieces.head
        return [adapter.make_cache(pieces.parts, 1), adapter.make_head_cache(head, 1) if head is not None else None]

    fingerprint = model_fingerprint(Path(model_dir), pieces.head is not None, pieces.hidden_state)
    cache.disk = DiskPrefixStore(Path(folder), max_bytes, fingerprint, fresh_caches)
    log.info("prefix cache on disk: %s, up to %d MiB (%d entries found)", cache.disk.folder, max_bytes >> 20,
             len(cache.disk.entries))
    return cache.disk
