"""The plan of `mlxmtp add-mtp-weights`: where the source head is, what it becomes.

Reads configs and safetensors headers only (no tensor data): which source shards hold
`mtp.*` (an HF id downloads just those), one `Job` per MTPHead parameter with its shape,
and the source dtype. `quantization.choose_quantization` then sets each job's quantization.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from tqdm.auto import tqdm

from ..checkpoint import hf_head, mtp_folder
from ..checkpoint.tensor_files import ST_DTYPES, TensorFileError, TensorReader, nbytes
from ..mlxlm.family import UnsupportedModelError, family_of
from ..models import demo
from ..models.errors import ModelLoadError
from ..models.hub import hub_snapshot


class AddMTPError(ValueError):
    """Refused: the message says why; nothing was written."""


Echo = Callable[[str], None]


# ---------------------------------------------------------------------------
# Source: local folder or HF id, only the shards holding the head
# ---------------------------------------------------------------------------


def _snapshot(repo_id: str, patterns: List[str], revision: Optional[str], progress: bool) -> Path:
    try:
        return hub_snapshot(repo_id, patterns, revision, tqdm_class=tqdm if progress else None)
    except ModelLoadError as e:  # network / cache / auth errors: one clear message
        raise AddMTPError(str(e)) from e


def local_source(source: str, revision: Optional[str] = None) -> Optional[Path]:
    """The local folder `source` names (None: a repo id, or nothing); a revision is refused
    with a folder or the demo, as `--revision` is for a Hugging Face repo id only."""
    if demo.names_demo(source) and revision is not None:
        raise AddMTPError(f"--revision applies to a Hugging Face repo id only; --source {source} is the demo model")
    p = Path(source).expanduser()
    if not p.is_dir():
        return None
    if revision is not None:
        raise AddMTPError(f"--revision applies to a Hugging Face repo id only; --source {source} is a local folder")
    return p


def fetch_source(source: str, *, shards: bool = True, revision: Optional[str] = None,
                 progress: bool = True) -> Tuple[Path, Dict[str, str]]:
    """(folder, {mtp tensor: shard}). An HF id downloads config + index, then (if `shards`)
    only the shards that hold `mtp.*` tensors; the demo (`mlxmtp-demo`) its head in HF layout."""
    if demo.names_demo(source):
        local_source(source, revision)  # refuses a revision
        folder = demo_source()
        return folder, hf_head.mtp_tensor_files(folder)
    local = local_source(source, revision)
    if local is not None:
        return local, hf_head.mtp_tensor_files(local)
    p = Path(source).expanduser()
    if p.exists() or source.count("/") != 1 or source.startswith((".", "/", "~")):
        raise AddMTPError(f"source {source!r} is neither a model folder nor a Hugging Face repo id")
    base = ["config.json", "model.safetensors.index.json"]
    folder = _snapshot(source, base, revision, progress=False)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = hf_head.mtp_tensor_files(folder)
        wanted = sorted(set(files.values()))
    else:  # a single-file checkpoint: the head can only be in model.safetensors
        files, wanted = {}, ["model.safetensors"]
    if shards and wanted:
        folder = _snapshot(source, base + wanted, revision, progress=progress)
        if not index.exists():
            files = hf_head.mtp_tensor_files(folder)
    return folder, files


_DEMO_SOURCE: List[Path] = []  # the demo's head in HF layout, exported once per process


def demo_source() -> Path:
    """A folder holding the demo's head in HF layout (models.demo.export_head), in a
    temporary folder removed when the process ends: a source for quantized copies of the
    demo, made from the shipped head, offline."""
    if not _DEMO_SOURCE:
        folder = Path(tempfile.mkdtemp(prefix="mlxmtp-demo-head-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        try:
            _DEMO_SOURCE.append(demo.export_head(folder))
        except (OSError, ValueError) as e:
            raise AddMTPError(f"cannot export the demo model's head: {e}") from e
    return _DEMO_SOURCE[0]


# ---------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------


@dataclass
class Job:
    """One MTPHead parameter and how to build it from source tensors: an hf_head.HeadTensor
    with the shape and quantization the plan gives it."""

    out: str  # MTPHead parameter name, e.g. "layers.0.mlp.switch_mlp.gate_proj.weight"
    kind: str  # copy | norm | stack | gate_half | up_half (see hf_head.head_form)
    sources: List[str]  # full `mtp.*` names (stack: ordered by expert)
    shape: Tuple[int, ...]  # shape of the (unquantized) result
    quant: Optional[dict] = None  # {"bits", "group_size", "mode"} or None


@dataclass
class Plan:
    model_dir: Path
    source: str
    source_dir: Optional[Path]
    source_config: dict
    target_config: dict
    family: str
    files: Dict[str, str]  # mtp tensor -> shard
    tensors: Dict[str, dict] = field(default_factory=dict)  # mtp tensor -> {dtype, shape} (headers)
    jobs: List[Job] = field(default_factory=list)
    info: dict = field(default_factory=dict)  # expert_layout, num_experts, num_layers, moe
    dtype: Optional[str] = None  # source float dtype ("bfloat16", ...)
    quantization: Optional[dict] = None  # mlx-lm style, head-relative paths
    choice: List[str] = field(default_factory=list)  # human-readable lines about the choice
    existing: Optional[str] = None  # why the target already has a head

    @property
    def shards(self) -> List[str]:
        return sorted(set(self.files.values()))

    def source_bytes(self) -> int:
        return sum(nbytes(t) for t in self.tensors.values())

    def describe(self) -> str:
        lines = [
            f"target:  {self.model_dir} ({self.family})",
            f"source:  {self.source}" + (f" -> {self.source_dir}" if self.source_dir else ""),
            f"source shards to read ({len(self.shards)}): {', '.join(self.shards)}",
            f"mtp tensors: {len(self.files)}"
            + (f" ({self.source_bytes() / 2**20:.1f} MiB {self.dtype})" if self.tensors else "")
            + f", layout {self.info.get('expert_layout')}, experts {self.info.get('num_experts')}, "
            f"layers {self.info.get('num_layers')}",
        ]
        lines += [f"  {n} {self.tensors[n]['dtype']} {list(self.tensors[n]['shape'])} [{self.files[n]}]"
                  if n in self.tensors else f"  {n} [{self.files[n]}]" for n in sorted(self.files)]
        lines += self.choice
        return "\n".join(lines)


def existing_head(model_dir: Path) -> Optional[str]:
    """Why the model already has a usable head (None: it has none). An `mtp/` folder that is
    not whole counts as none: the loader reports no head (or an unreadable one) for it."""
    model_dir = Path(model_dir)
    folder = model_dir / mtp_folder.FOLDER
    if os.path.lexists(folder) and mtp_folder.folder_problem(folder) is None:
        return f"{folder} exists"
    if mtp_folder.has_mtp_folder(model_dir):  # the loader reads this broken folder, not the shards
        return None
    files = hf_head.mtp_tensor_files(model_dir)
    if files:
        return f"its own safetensors hold {len(files)} mtp.* tensors ({', '.join(sorted(set(files.values())))})"
    return None


def make_jobs(files: Dict[str, str]) -> Tuple[List[Job], dict]:
    """Jobs (without shapes) turning HF `mtp.*` names into MTPHead names (hf_head's mapping)."""
    try:
        mapping, info = hf_head.map_head_names(files)
    except hf_head.HeadConversionError as e:
        raise AddMTPError(f"source {e}") from e
    return [Job(t.out, t.kind, list(t.sources), ()) for t in mapping], info


def _job_shape(job: Job, tensors: Dict[str, dict]) -> Tuple[int, ...]:
    shape = tuple(tensors[job.sources[0]]["shape"])
    if job.kind == "stack":
        return (len(job.sources),) + shape
    if job.kind in ("gate_half", "up_half"):
        return shape[:-2] + (shape[-2] // 2, shape[-1])
    return shape


def plan(model_dir, source: str, *, download: bool = True, revision: Optional[str] = None,
         progress: bool = True) -> Plan:
    """Read configs and headers (no tensor data): the source shards, the jobs and their
    shapes, the source dtype (the jobs' quantization is `quantization.choose_quantization`'s)."""
    model_dir = Path(model_dir)
    target_config, family = read_target_config(model_dir)
    source_dir, files = fetch_source(source, shards=download, revision=revision, progress=progress)
    source_config = json.loads((source_dir / "config.json").read_text()) \
        if (source_dir / "config.json").exists() else {}
    if not files:
        raise AddMTPError(f"source {source} has no mtp.* tensors (its index / safetensors list none): "
                          "use the original BF16 checkpoint, not a converted one")
    p = Plan(model_dir, source, source_dir, source_config, target_config, family, files,
             existing=existing_head(model_dir))
    p.jobs, p.info = make_jobs(files)
    if all((source_dir / s).exists() for s in p.shards):
        _read_source_headers(p)
    return p


def read_target_config(model_dir: Path) -> Tuple[dict, str]:
    """(config, family) of the MLX model folder to repair."""
    if not (model_dir / "config.json").exists():
        raise AddMTPError(f"{model_dir} is not an MLX model folder (no config.json)")
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise AddMTPError(f"{model_dir / 'config.json'} cannot be read: {e}") from e
    try:
        return config, family_of(config)
    except UnsupportedModelError as e:
        raise AddMTPError(f"target: {e}") from e


def _read_source_headers(p: Plan) -> None:
    """Source tensor shapes and dtypes (headers only): the jobs' shapes, the source dtype,
    and a fused layout's expert count."""
    reader = TensorReader(p.source_dir)
    try:
        p.tensors = {n: reader.info(s, n) for n, s in p.files.items()}
    except TensorFileError as e:
        raise AddMTPError(str(e)) from e
    for job in p.jobs:
        job.shape = _job_shape(job, p.tensors)
    if p.info["expert_layout"] == "fused":
        p.info["num_experts"] = next(j.shape[0] for j in p.jobs if j.kind == "gate_half")
    dtypes = {t["dtype"] for t in p.tensors.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in ST_DTYPES:
        raise AddMTPError(f"source mtp.* tensors have dtypes {sorted(dtypes)}; expected one float dtype")
    p.dtype = ST_DTYPES[next(iter(dtypes))][2]
