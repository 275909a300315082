"""Which files in the prefix cache's folder are the server's (engine/prefix/disk.py keeps them).

The folder given (`serve --prefix-cache-dir D`) may hold anything else: notes, another
tool's files, links. The server deletes, and counts toward the budget, only files it
recognises as its own (an entry's `<32 hex>.json` / `<32 hex>.safetensors`, and their
temporaries `tmp-<pid>-<32 hex>.<ext>`), and only inside subfolders it marked as its own
when it created them (`D/<20 hex>/` holding MARKER). Everything else is left alone.
Symbolic links are never followed, neither when scanning, sizing, reading nor deleting: a
link is left alone too, and what it points to is never reached.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path
from typing import List, Optional, Tuple

from ...checkpoint.mtp_folder import another_process_running

log = logging.getLogger("mlxmtp")

MARKER = ".mlxmtp-prefix-cache"  # in every subfolder the server created: its files may be deleted
_MARKER_TEXT = "mlxmtp's prefix cache: the server deletes only the files named like its entries here.\n"
FINGERPRINT = re.compile(r"[0-9a-f]{20}")  # prefix_files.model_fingerprint's names
ENTRY_FILE = re.compile(r"(?:tmp-(\d+)-)?([0-9a-f]{32})\.(?:json|safetensors)")  # temporaries too


def in_use(name: str) -> bool:
    """Whether `name` is a temporary file another process still running is writing (two
    servers may share a folder: one's start-up must not delete the other's write)."""
    m = ENTRY_FILE.fullmatch(name)
    return bool(m and m.group(1)) and another_process_running(int(m.group(1)))


def _lstat(path: Path) -> Optional[os.stat_result]:
    """`path`'s own status (a link's, not its target's); None where it cannot be had."""
    try:
        return os.lstat(path)
    except OSError:
        return None


def file_size(path: Path) -> Optional[int]:
    """The size of `path` if it is a regular file (not a link), else None."""
    st = _lstat(path)
    return st.st_size if st is not None and stat.S_ISREG(st.st_mode) else None


def is_regular_file(path: Path) -> bool:
    return file_size(path) is not None


def is_marked(folder: Path) -> bool:
    """Whether `folder` is a real folder (no link) that the server created."""
    st = _lstat(folder)
    return st is not None and stat.S_ISDIR(st.st_mode) and is_regular_file(folder / MARKER)


def prepare(folder: Path) -> Optional[str]:
    """Make `folder` a marked folder of the server's: created with its marker where it
    does not exist, marked where it exists empty. None when done, else why it is unusable
    (a link, a file, or a folder of someone else's files: nothing is written there)."""
    st = _lstat(folder)
    if st is not None and stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if st is not None and not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st is not None and not is_regular_file(folder / MARKER):
        with os.scandir(folder) as items:
            if any(True for _ in items):
                return f"holds files the server did not write (it has no {MARKER})"
    folder.mkdir(parents=True, exist_ok=True)
    if not is_regular_file(folder / MARKER):
        (folder / MARKER).write_text(_MARKER_TEXT)
    return None


def own_files(folder: Path) -> Tuple[List[Tuple[str, os.stat_result]], List[str]]:
    """(the server's files in `folder`, by name with their lstat, the names of the rest)."""
    mine, others = [], []
    with os.scandir(folder) as items:
        for item in items:
            if item.name == MARKER:
                continue
            if ENTRY_FILE.fullmatch(item.name) and item.is_file(follow_symlinks=False):
                mine.append((item.name, item.stat(follow_symlinks=False)))
            else:
                others.append(item.name)
    return mine, others


def other_models(root: Path, own: Path) -> Tuple[List[Tuple[int, int, Path]], List[str]]:
    """(the server's folders in `root` other than `own`, as (the latest change of their
    files, their files' bytes, the folder), the names of what else `root` holds)."""
    folders, others = [], []
    with os.scandir(root) as items:
        for item in items:
            path = Path(item.path)
            if item.name == own.name:
                continue
            if not (FINGERPRINT.fullmatch(item.name) and is_marked(path)):
                others.append(item.name)
                continue
            files, _ = own_files(path)
            folders.append((max((st.st_mtime_ns for _, st in files), default=0),
                            sum(st.st_size for _, st in files), path))
    return folders, others


def empty(folder: Path) -> None:
    """Delete the server's files in `folder`, then its marker and the folder itself
    (which stays, with the marker gone, if it holds anything else)."""
    try:
        files, _ = own_files(folder)
    except OSError:  # gone already, or not readable: it stays as it is
        return
    for name, _ in files:
        remove(folder / name)
    remove(folder / MARKER)
    try:
        folder.rmdir()
    except OSError:
        pass


def open_file(path: Path):
    """`path` opened for reading in binary mode; an OSError where it is a link."""
    return os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb")


def touch(path: Path) -> None:
    """Mark `path` (a link: never followed) as just used; a failure only loses that."""
    try:
        os.utime(path, follow_symlinks=False)
    except OSError:
        pass


def remove(path: Path) -> None:
    """Delete `path` if it is a regular file (a link, a folder: never). A failure leaves
    it: it only costs room."""
    try:
        if is_regular_file(path):
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("prefix cache on disk: could not delete %s: %s", path, e)
