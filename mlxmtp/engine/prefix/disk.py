"""Prefix cache entries kept on disk: the ones memory evicts, and those held at shutdown.

A coding agent's prompt starts with tens of thousands of tokens of system prompt and tools.
On a large model that is tens of seconds of prefill, and its state (Qwen3.5-27B: 64 KiB of
KV per token plus the Gated DeltaNet states) is what the memory budget evicts first when
several agents run, and what a restart loses. Read back from an SSD it takes well under a
second. So with a folder given (`serve --prefix-cache-dir`), the prefix cache writes an
entry here when it evicts it and when the server stops, and a prompt that starts with a
stored sequence longer than any in memory loads that state instead of prefilling it.

One entry is two files (prefix_files.py), renamed into place once complete: an entry
whose files are incomplete is deleted at start-up. The folder holds one subfolder per model
fingerprint (the model's files, the head, mlx and mlx-lm versions): a state is only ever
restored into the model that computed it, only if it is exactly what was written and of
the model's shapes (prefix_check.py), so a hit gives the output a miss would. Least
recently used files go first once the folder's budget is reached; only files the server
wrote are ever deleted or counted, and links are never followed (prefix_folders.py). A
failure costs only the saving: a state that fails its checks is a miss (and deleted), a
failed write leaves no entry, and a folder changed under the server is read again.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx

from . import check as prefix_check
from . import files as prefix_files
from . import folders as prefix_folders
from .cache import PrefixEntry
from .files import model_fingerprint
from .trie import PrefixTrie, Tokens

log = logging.getLogger("mlxmtp")
MIN_FREE_BYTES = 2 << 30  # the least a write leaves free on the disk (see DiskPrefixStore._room_for)
_DATA_PROBLEMS = (OSError, ValueError, KeyError, TypeError, RuntimeError)  # what reading an index may raise


@dataclass
class DiskEntry:
    """An entry on disk, as the index knows it (its arrays stay in the file)."""

    tokens: Tokens
    name: str
    nbytes: int  # the entry's bytes in memory once loaded
    file_bytes: int
    has_logits: bool


class DiskPrefixStore:
    """Entries in `folder / fingerprint`, at most `max_bytes` of files."""

    def __init__(self, folder: Path, max_bytes: int, fingerprint: str, model_state: Callable[[], PrefixEntry]):
        self.folder = Path(folder) / fingerprint
        # -> the running model's state after one token, unevaluated (prefix_check.model_state):
        # the shapes a loaded entry must have. Called on the first load (the engine's thread).
        self.model_state = model_state
        self._model: Optional[Tuple[PrefixEntry, prefix_check.Shapes]] = None
        self.max_bytes = max_bytes
        self.entries: Dict[Tokens, DiskEntry] = {}
        self.trie = PrefixTrie()
        self.bytes = 0
        self.loads = 0
        self.rejected = 0  # entries found for a prompt but not used (see load), each deleted
        self.warned_full = False  # the disk was too full for the last write (warned once)
        self.usable = True  # False: the folder cannot be used (a link, say): nothing is read or written
        self.noted_others = False  # what the server did not write was logged (once)
        self.rescan()
        if self.usable:
            self._make_room_among_models()

    # ------------------------------------------------------------------ the index
    def rescan(self) -> None:
        """Know the entries the folder holds now (not what this store last knew), creating
        the folder and its marker where they are gone. A folder that cannot be used turns
        the store off (warned once)."""
        self.entries, self.trie, self.bytes = {}, PrefixTrie(), 0
        try:
            why = prefix_folders.prepare(self.folder)
            if why is None:
                self._read_index()
        except OSError as e:
            why = f"cannot be used ({e})"
        if why is not None:
            self.entries, self.trie, self.bytes = {}, PrefixTrie(), 0
            if self.usable:
                log.warning("prefix cache on disk: %s %s: nothing is read or written there", self.folder, why)
            self.usable = False

    def _read_index(self) -> None:
        """The complete entries in the folder, oldest first; the server's other files there
        (temporaries, arrays without their index, files cut short or changed) deleted."""
        files, others = prefix_folders.own_files(self.folder)
        self._note_others(others, self.folder)
        sizes = {name: st.st_size for name, st in files}
        complete = set()
        for name, _ in sorted(files, key=lambda f: f[1].st_mtime_ns):
            stem = name[: -len(".json")]
            entry = self._indexed(stem, sizes.get(stem + ".safetensors")) if name.endswith(".json") else None
            if entry is not None:
                self._add(entry)
                complete.update((name, stem + ".safetensors"))
        for name, _ in files:
            if name not in complete and not prefix_folders.in_use(name):
                prefix_folders.remove(self.folder / name)

    def _indexed(self, name: str, file_bytes: Optional[int]) -> Optional[DiskEntry]:
        """The entry `name`.json describes, if complete: its index intact and of its tokens,
        its arrays' file (`file_bytes` long, None: missing) as long as when written."""
        if file_bytes is None or name.startswith("tmp-"):
            return None
        try:
            with prefix_folders.open_file(self.folder / (name + ".json")) as f:
                meta = prefix_check.index_of(f.read().decode(), name)
            if meta["file_bytes"] == file_bytes:
                return DiskEntry(tuple(meta["tokens"]), name, int(meta["nbytes"]), file_bytes, bool(meta["has_logits"]))
        except _DATA_PROBLEMS:
            pass
        return None

    def _note_others(self, names: List[str], where: Path) -> None:
        if names and not self.noted_others:
            self.noted_others = True
            log.info("prefix cache on disk: %s holds what the server did not write (%s%s): left alone, never "
                     "deleted nor counted (a folder of an older version, without %s, may be deleted by hand)",
                     where, ", ".join(sorted(names)[:5]), ", ..." if len(names) > 5 else "", prefix_folders.MARKER)

    def _make_room_among_models(self) -> None:
        """Hold the whole folder to the budget: other models' subfolders (other versions of
        mlx / mlx-lm, of the model's files) count too, and leave whole, least recently used
        first, while it is over; this model's own entries then keep what the rest leave."""
        try:
            others, strangers = prefix_folders.other_models(self.folder.parent, self.folder)
        except OSError as e:
            log.warning("prefix cache on disk: could not look through %s (%s)", self.folder.parent, e)
            others, strangers = [], []
        self._note_others(strangers, self.folder.parent)
        others.sort(key=lambda o: o[0])
        total = self.bytes + sum(size for _, size, _ in others)
        while others and total > self.max_bytes:
            _, size, folder = others.pop(0)
            log.info("prefix cache on disk: %s (another model's, or older versions') emptied to keep the "
                     "folder within its budget", folder)
            prefix_folders.empty(folder)
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
            prefix_folders.remove(self.folder / (entry.name + suffix))

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

    # ------------------------------------------------------------------ writing
    def save(self, entry: PrefixEntry) -> None:
        """Write `entry` unless it is stored already, larger than the whole budget, or the
        disk has no room for it (see `_room_for`)."""
        if not self.usable or entry.nbytes > self.max_bytes or self._stored(entry.tokens):
            return
        try:
            if self._room_for(entry.nbytes):
                self._write(entry)
        except Exception as e:  # noqa: BLE001 - a full disk, say: the entry is only a saving of work
            log.warning("could not write a prefix cache entry of %d tokens to %s: %s", len(entry.tokens),
                        self.folder, e)
            self.rescan()

    def _stored(self, tokens: Tokens) -> bool:
        """Whether the state after `tokens` is in the folder (or the store is off). The folder
        is read again first where the index lists it but its files are gone or changed, or
        where the folder lost its marker (deleted, or replaced)."""
        known = self.entries.get(tokens)
        if known is not None and self._intact(known):
            return True
        if known is not None or not prefix_folders.is_marked(self.folder):
            log.info("prefix cache on disk: %s changed under the server: read again", self.folder)
            self.rescan()
        return tokens in self.entries or not self.usable

    def _intact(self, entry: DiskEntry) -> bool:
        return (prefix_folders.is_regular_file(self.folder / (entry.name + ".json"))
                and prefix_folders.file_size(self.folder / (entry.name + ".safetensors")) == entry.file_bytes)

    def _write(self, entry: PrefixEntry) -> None:
        """Write the entry's two files (the index last), then make room for them."""
        name = prefix_files.entry_name(entry.tokens)
        arrays, meta = prefix_files.flatten(entry)
        meta["arrays"] = prefix_check.describe(arrays)
        data, index = self.folder / (name + ".safetensors"), self.folder / (name + ".json")
        try:
            prefix_files.write_atomically(data, lambda tmp: mx.save_safetensors(str(tmp), arrays))
            meta["file_bytes"] = file_bytes = os.lstat(data).st_size
            prefix_files.write_atomically(index, lambda tmp: tmp.write_text(prefix_check.seal(meta)))
        except BaseException:
            prefix_folders.remove(index)
            prefix_folders.remove(data)
            raise
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

    # ------------------------------------------------------------------ reading
    def load(self, found: DiskEntry) -> Optional[PrefixEntry]:
        """The entry's state; None, counted in `rejected` and the entry deleted, when its
        files cannot be read (the folder is then read again), are not exactly what was
        written, or do not fit the running model's shapes."""
        try:
            arrays, meta = self._read(found)
            model, shapes = self._model_shapes()
            prefix_check.check_fits(arrays, shapes)
            entry = prefix_files.rebuild(found.tokens, arrays, meta, [model.cache, model.head_cache], found.nbytes)
        except Exception as e:  # noqa: BLE001 - whatever the files hold, they cost only the saving
            log.warning("prefix cache entry %s on disk is not used (%s): deleted", found.name, e)
            self.rejected += 1
            self._drop(found)
            if isinstance(e, OSError):  # gone, maybe with the whole folder
                self.rescan()
            return None
        prefix_folders.touch(self.folder / (found.name + ".json"))  # most recently used, also after a restart
        self.entries[found.tokens] = self.entries.pop(found.tokens)
        self.loads += 1
        return entry

    def _read(self, found: DiskEntry) -> Tuple[Dict[str, mx.array], dict]:
        """The entry's arrays and index, checked to be exactly what was written."""
        with prefix_folders.open_file(self.folder / (found.name + ".json")) as f:
            meta = prefix_check.index_of(f.read().decode(), found.name)
        if tuple(meta["tokens"]) != found.tokens:
            raise ValueError("its index is of other tokens")
        with prefix_folders.open_file(self.folder / (found.name + ".safetensors")) as f:
            arrays = mx.load(f, format="safetensors")
            mx.eval(*arrays.values())  # read while the file is open
        prefix_check.verify(arrays, meta["arrays"])
        return arrays, meta

    def _model_shapes(self) -> Tuple[PrefixEntry, prefix_check.Shapes]:
        if self._model is None:
            state = self.model_state()
            self._model = state, prefix_check.shapes_of(state)
        return self._model


def store_for(pieces, model, folder: Path, max_bytes: int, cache_bytes: int, lockstep: bool) -> DiskPrefixStore:
    """A disk store in `folder` of at most `max_bytes` for the prefix cache of `cache_bytes`
    in memory of an engine of `pieces` (engine/parts.py builds the cache with it);
    `lockstep`: the engine runs on the ranks of a distributed run."""
    model_dir = getattr(model, "model_dir", None)
    if model_dir is None:
        raise ValueError("a prefix cache on disk needs a model loaded from a folder")
    if cache_bytes <= 0:
        raise ValueError("a prefix cache on disk needs one in memory (--prefix-cache-mb above 0)")
    if lockstep:  # each rank would load and evict on its own
        raise ValueError("a prefix cache on disk is not supported across ranks (mlx.launch)")
    fingerprint = model_fingerprint(Path(model_dir), pieces.head is not None, pieces.hidden_state)
    disk = DiskPrefixStore(Path(folder), max_bytes, fingerprint, functools.partial(prefix_check.model_state, pieces))
    if disk.usable:
        log.info("prefix cache on disk: %s, up to %d MiB (%d entries found)", disk.folder, max_bytes >> 20,
                 len(disk.entries))
    return disk
