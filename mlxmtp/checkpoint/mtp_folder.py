"""The `mtp/` folder: an MTP head injected into an MLX model folder.

Layout (format_version 1):
    MODEL_DIR/mtp/config.json         small JSON, see `make_head_config`
    MODEL_DIR/mtp/weights.safetensors MTPHead parameters in mlx naming
                                      (`fc.weight`, `layers.0.mlp.switch_mlp...`),
                                      norms already shifted (+1 applied once),
                                      quantized per config["quantization"].

It lives in a subfolder, never in `model*.safetensors`: stock mlx-lm loads every
top-level `*.safetensors` file, and `mtp.*` keys there break its strict load
(Qwen3-Next) or get their norms shifted again (older Qwen3.5 sanitize).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import mlx.core as mx

from .tensor_files import read_header

FOLDER = "mtp"
CONFIG = "config.json"
WEIGHTS = "weights.safetensors"
FORMAT = "mlxmtp-mtp-head"
FORMAT_VERSION = 1
# Staging folders next to mtp/ (no loader reads them): the new head being written, and the
# previous head while a replacement swaps them.
TMP_PREFIX = ".mtp-tmp-"
OLD_PREFIX = ".mtp-old-"
# Their whole names, `.mtp-tmp-PID-` + mkdtemp's letters and `.mtp-old-PID`: what a later
# run may remove once PID has ended. Any other name is not this module's and is never touched.
_STAGING_NAME = re.compile(rf"{re.escape(TMP_PREFIX)}(\d+)-[a-z0-9_]+|{re.escape(OLD_PREFIX)}(\d+)")


class MTPFolderError(ValueError):
    pass


def make_head_config(
    *,
    source: str,
    family: str,
    info: dict,
    quantization: Optional[dict],
    dtype: str,
    hidden_state: str = "post_norm",
) -> dict:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "source": source,  # the checkpoint the head was taken from
        "family": family,
        "num_layers": info["num_layers"],
        "expert_layout": info["expert_layout"],  # layout in the source: dense/per_expert/fused
        "num_experts": info["num_experts"],
        "moe": info["moe"],
        "norms_shifted": True,  # mlx convention: +1 already applied, never apply again
        "quantization": quantization,  # mlx-lm style dict, None for unquantized
        "dtype": dtype,
        "hidden_state": hidden_state,
    }


def has_mtp_folder(model_dir: Path) -> bool:
    return (Path(model_dir) / FOLDER / CONFIG).exists() and (Path(model_dir) / FOLDER / WEIGHTS).exists()


def config_problem(config, required: Iterable[str] = ()) -> Optional[str]:
    """Why a parsed `mtp/config.json` is not one of this format holding the `required`
    fields (None: it is)."""
    if not isinstance(config, dict) or not set(required) <= config.keys() or (
            config.get("format"), config.get("format_version")) != (FORMAT, FORMAT_VERSION):
        return f"its {CONFIG} is not that of an mlxmtp head folder of format version {FORMAT_VERSION}"
    return None


def folder_problem(folder: Path) -> Optional[str]:
    """Why `folder` is not a whole head folder as `write_mtp_folder` leaves one (None: it is):
    a file missing, a config of another format, a weights file whose header does not parse or
    whose data is cut short. Reads the config and the weights' header only."""
    folder = Path(folder)
    if not folder.is_dir():
        return "not a folder"
    for name in (CONFIG, WEIGHTS):
        if not (folder / name).is_file():
            return f"no {name}"
    try:
        config = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError) as e:
        return f"unreadable {CONFIG}: {e}"
    problem = config_problem(config)
    if problem:
        return problem
    try:
        header, start = read_header(folder / WEIGHTS)
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
        size = (folder / WEIGHTS).stat().st_size
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"unreadable {WEIGHTS}: {e}"
    if size < start + end:
        return f"{WEIGHTS} is cut short ({size} of {start + end} bytes)"
    return None


def read_mtp_folder(model_dir: Path) -> Tuple[dict, Dict[str, mx.array]]:
    folder = Path(model_dir) / FOLDER
    config = json.loads((folder / CONFIG).read_text())
    if config.get("format") != FORMAT or config.get("format_version") != FORMAT_VERSION:
        raise MTPFolderError(f"{folder} is not an mlxmtp head folder of format version {FORMAT_VERSION}")
    if config.get("norms_shifted") is not True:
        raise MTPFolderError(
            f"{folder / CONFIG} does not record norms_shifted=true; refusing to guess the norm convention"
        )
    return config, mx.load(str(folder / WEIGHTS))


# ---------------------------------------------------------------------------
# Writing: a staging folder, then renames; and the repair of a killed replacement
# ---------------------------------------------------------------------------


def check_writable(model_dir: Path) -> None:
    """Raise OSError where `write_mtp_folder` could not make its staging folder."""
    os.rmdir(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-", dir=model_dir))


def write_mtp_folder(model_dir: Path, config: dict, weights: Dict[str, mx.array], *, force: bool = False) -> Path:
    """Write `mtp/` atomically: a staging folder `.mtp-tmp-PID-*`, then a rename.

    A crash leaves `mtp/` as it was (none, or the previous head) or the complete new one,
    plus at most a staging folder no loader reads. `force` replaces an existing `mtp/` with
    two renames (old -> `.mtp-old-PID`, new -> `mtp/`); an exception between them puts the
    old one back, and a kill between them (`mtp/` missing) is undone by `recover_swap`, which
    moves the complete new head (else the old one) into place.
    """
    model_dir = Path(model_dir)
    final = model_dir / FOLDER
    if os.path.lexists(final) and not force:
        raise MTPFolderError(f"{final} already exists (use --force to replace it)")
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-", dir=model_dir))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the model folder's readers need it too
        _fill(tmp, config, weights)
        _swap(model_dir, tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _fill(tmp: Path, config: dict, weights: Dict[str, mx.array]) -> None:
    """Weights first, then config.json by a rename: a staging folder with a config.json is
    whole (what `recover_swap` relies on). Data on disk before any rename makes it visible."""
    mx.save_safetensors(str(tmp / WEIGHTS), weights, metadata={"format": "mlx"})
    part = tmp / f"{CONFIG}.part"
    part.write_text(json.dumps(config, indent=2) + "\n")
    for f in (tmp / WEIGHTS, part):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    os.replace(part, tmp / CONFIG)


def _swap(model_dir: Path, tmp: Path, final: Path) -> None:
    """`tmp` -> `final`; a previous `final` is moved aside first and removed after."""
    if not os.path.lexists(final):
        os.replace(tmp, final)
        return
    old = model_dir / f"{OLD_PREFIX}{os.getpid()}"
    _remove(old)  # a leftover of an earlier call of this process would block the rename
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        os.replace(old, final)  # the previous head back where it was
        raise
    _remove(old)


def _remove(path: Path) -> None:
    """Remove a staging folder. A file or link by that name was not made here: it stays
    (and the rename it blocks then fails cleanly)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)


def _staging_pid(path: Path) -> Optional[int]:
    """The PID in a staging folder's name (`.mtp-tmp-PID-xyz`, `.mtp-old-PID`); None for a
    name this module does not give."""
    m = _STAGING_NAME.fullmatch(path.name)
    return int(m.group(1) or m.group(2)) if m else None


def another_process_running(pid: int) -> bool:
    """Whether `pid` is another process that is still running (the writer of a staging
    name here, or of a prefix cache temporary: engine/prefix/folders.py)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except PermissionError:
        return True  # exists, another user's
    except (OSError, OverflowError):
        return False
    return True


def _stale(path: Path) -> bool:
    """Whether `path` is a staging folder (a real folder of `_STAGING_NAME`) of a run that is over."""
    pid = _staging_pid(path)
    return pid is not None and path.is_dir() and not path.is_symlink() and not another_process_running(pid)


def leftovers(model_dir: Path) -> List[Path]:
    """Staging folders of runs that are over (killed, or crashed past their cleanup); see `_stale`."""
    model_dir = Path(model_dir)
    found = sorted(model_dir.glob(f"{TMP_PREFIX}*")) + sorted(model_dir.glob(f"{OLD_PREFIX}*"))
    return [p for p in found if _stale(p)]


def interrupted_head(model_dir: Path) -> Optional[Path]:
    """With `mtp/` missing: the whole head a killed run left, the newest new one (its
    staging folder was complete) else the previous one it had moved aside; None if none."""
    model_dir = Path(model_dir)
    if os.path.lexists(model_dir / FOLDER):
        return None
    whole = [p for p in leftovers(model_dir) if folder_problem(p) is None]
    for prefix in (TMP_PREFIX, OLD_PREFIX):
        found = [p for p in whole if p.name.startswith(prefix)]
        if found:
            return max(found, key=lambda p: p.stat().st_mtime)
    return None


def recover_swap(model_dir: Path, *, dry_run: bool = False) -> List[str]:
    """Finish what a killed run left: a whole head back into a missing `mtp/`
    (`interrupted_head`), the other staging folders of finished runs removed. Lines saying
    what was done (`dry_run`: what would be, nothing is touched). Raises OSError."""
    model_dir = Path(model_dir)
    final = model_dir / FOLDER
    notes = []
    head = interrupted_head(model_dir)
    if head is not None:
        which = "its new head" if head.name.startswith(TMP_PREFIX) else "the previous head"
        notes.append(f"{final} is missing after an interrupted run: "
                     f"{'would restore' if dry_run else 'restored'} {which} from {head.name}")
        if not dry_run:
            os.replace(head, final)
    stale = [p for p in leftovers(model_dir) if p != head]
    if stale:
        notes.append(f"{'would remove' if dry_run else 'removed'} what interrupted runs left: "
                     + ", ".join(p.name for p in stale))
        if not dry_run:
            for p in stale:
                _remove(p)
    return notes
