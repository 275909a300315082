"""The process group of a distributed run, and the start-up check that every rank loads
the same model with the same settings (a rank with another folder would compute other
hidden states, and nothing else would notice)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..checkpoint import mtp_folder, tensor_files
from ..engine.config import EngineConfig
from .channel import Channel
from .links import open_sockets

# What identifies a model folder: its configs and its weight index (or the headers of its
# weight files when it has no index), and the MTP head's config and header.
_IDENTITY = ("config.json", "model.safetensors.index.json", f"{mtp_folder.FOLDER}/{mtp_folder.CONFIG}")


class SetupMismatchError(RuntimeError):
    """Ranks started with different model folders or settings."""


# The sockets `mx.distributed.init` opened (links.py): this process's links to the other ranks.
PEER_SOCKETS: set = set()


def launched_group():
    """The group `mlx.launch` started this process in, or None when run alone."""
    before = open_sockets()
    group = mx.distributed.init()
    PEER_SOCKETS.update(open_sockets() - before)
    return group if group.size() > 1 else None


def folder_fingerprint(model_dir: Path) -> bytes:
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    for name in _IDENTITY:
        if (model_dir / name).exists():
            h.update(name.encode() + b"\0" + (model_dir / name).read_bytes())
    headers = [] if (model_dir / "model.safetensors.index.json").exists() else sorted(model_dir.glob("*.safetensors"))
    head = model_dir / mtp_folder.FOLDER / mtp_folder.WEIGHTS
    for path in headers + ([head] if head.exists() else []):
        header, _ = tensor_files.read_header(path)
        h.update(json.dumps({k: [v["dtype"], v["shape"]] for k, v in header.items()}, sort_keys=True).encode())
    return h.digest()


def setup_digest(config: Optional[EngineConfig] = None, load_options: Optional[dict] = None) -> bytes:
    """What a rank compares with rank 0's besides the model folder: every field of the
    engine config it builds its engine from, and the options it loaded the model with."""
    setup = {"engine": dataclasses.asdict(config) if config is not None else {}, "load": load_options or {}}
    return hashlib.sha256(json.dumps(setup, sort_keys=True, default=str).encode()).digest()


def check_same_setup(channel: Channel, model_dir: Path, config: Optional[EngineConfig] = None,
                     load_options: Optional[dict] = None) -> None:
    """Raise SetupMismatchError, on every rank alike, unless every rank has the same model
    folder (by fingerprint), engine config and load options as rank 0 (setup_digest)."""
    mine = folder_fingerprint(model_dir) + setup_digest(config, load_options)
    everyone = channel.gather_bytes(mine, 64)
    folders = [r for r, d in enumerate(everyone) if d[:32] != everyone[0][:32]]
    if folders:
        raise SetupMismatchError(
            f"rank(s) {folders} have a different model folder than rank 0 (config.json, safetensors index "
            "or MTP head differ): every rank must load the same model")
    options = [r for r, d in enumerate(everyone) if d[32:] != everyone[0][32:]]
    if options:
        raise SetupMismatchError(f"rank(s) {options} were started with other engine settings than rank 0: "
                                 "start every rank with the same command")
