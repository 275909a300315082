"""Repair a quantized MLX model folder that lost its MTP head (`mlxmtp add-mtp-weights`).

plan      -> which source shards hold `mtp.*`, what the head becomes (`plan.py`), how it is
             quantized (`quantization.py`);
validate  -> source config / tensor shapes / dtypes / norms against the target, refuse
             mismatches (`validation.py`);
convert   -> HF `mtp.*` -> MTPHead parameters (the mapping of `checkpoint.hf_head`: +1 norm
             shift once, experts stacked or split), quantized like the target, on the CPU,
             one tensor (and at most CHUNK_BYTES of source) at a time;
write     -> `mtp_folder.write_mtp_folder` (staging folder, then a rename); every run first
             finishes what a killed one left (`mtp_folder.recover_swap`).

The model's own shards are never touched: the head lives in `MODEL_DIR/mtp/`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from ..checkpoint import hf_head, mtp_folder
from ..checkpoint.norm_convention import norm_reference
from ..checkpoint.tensor_files import TensorReader, nbytes
from ..mlxlm.family import text_parts
from ..models.errors import MTPLoadError
from ..models.head_build import build_head, check_norm_convention
from .plan import (
    AddMTPError,
    Echo,
    Job,
    Plan,
    existing_head,
    local_source,
    plan,
    read_target_config,
)
from .quantization import QuantRequest, choose_quantization, quant_request
from .target import cpu, load_target
from .validation import validate

__all__ = ["AddMTPError", "add_mtp_weights"]

# Source bytes read per step when stacking / slicing experts (bounded memory).
CHUNK_BYTES = 64 << 20


def _chunks(job: Job, tensors: Dict[str, dict]) -> List[Tuple[int, int]]:
    """Expert ranges [lo, hi) of at most CHUNK_BYTES of source; [(0, 0)]: the whole tensor."""
    meta = tensors[job.sources[0]]
    if job.kind == "stack":
        n, one = len(job.sources), nbytes(meta)
    elif len(job.shape) == 3:
        n, one = meta["shape"][0], nbytes(meta, skip_axes=1)
    else:
        return [(0, 0)]
    step = max(1, CHUNK_BYTES // max(one, 1))
    return [(i, min(n, i + step)) for i in range(0, n, step)]


def _read_job_chunk(job: Job, p: Plan, reader: TensorReader, lo: int, hi: int) -> mx.array:
    if job.kind == "stack":
        return mx.stack([reader.read(p.files[s], s) for s in job.sources[lo:hi]])
    src = job.sources[0]
    if lo == hi == 0:
        w = reader.read(p.files[src], src)
    else:
        w = reader.read(p.files[src], src, lo, hi)
    return hf_head.head_form(job.kind, w)


def convert(p: Plan, echo: Optional[Echo] = None) -> Dict[str, mx.array]:
    """MTPHead parameters, quantized per the plan. At most one job's output plus CHUNK_BYTES
    of source (and its quantized form) are alive beyond what is already converted."""
    reader = TensorReader(p.source_dir)
    out: Dict[str, mx.array] = {}
    with cpu():
        for i, job in enumerate(p.jobs):
            pieces: Dict[str, List[mx.array]] = {}
            for lo, hi in _chunks(job, p.tensors):
                w = _read_job_chunk(job, p, reader, lo, hi)
                if job.quant is not None:
                    q = job.quant
                    res = mx.quantize(w, group_size=q["group_size"], bits=q["bits"], mode=q["mode"])
                    named = dict(zip(("weight", "scales", "biases"), res, strict=False))
                else:
                    named = {"weight": w}
                mx.eval(*named.values())
                del w
                for k, v in named.items():
                    pieces.setdefault(k, []).append(v)
                del named
            base = job.out.removesuffix(".weight")
            for k, vs in pieces.items():
                name = job.out if k == "weight" and not job.out.endswith(".weight") else f"{base}.{k}"
                arr = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=0)
                mx.eval(arr)
                out[name] = arr
            del pieces
            if echo and (job.kind == "stack" or len(job.shape) == 3):
                echo(f"  [{i + 1}/{len(p.jobs)}] {job.out} {list(job.shape)}"
                     + (f" -> {job.quant['bits']}-bit" if job.quant else ""))
    return out


def check_loads(p: Plan, target, weights: Dict[str, mx.array]) -> None:
    """Build the head exactly as `mlxmtp.load` will (quantize_like + strict load) before writing."""
    with cpu():
        try:
            parts = text_parts(target)
            head = build_head(parts, weights, p.info, p.quantization)
            check_norm_convention(norm_reference(parts.backbone), head)
        except MTPLoadError as e:
            raise AddMTPError(f"the converted head would not load: {e}") from e


def write(p: Plan, weights: Dict[str, mx.array], *, force: bool = False) -> Path:
    """MODEL/mtp/ from the converted weights; a disk error is an AddMTPError (the staging
    folder removed, a previous head left in place by `write_mtp_folder`)."""
    model_dir = p.model_dir
    config = mtp_folder.make_head_config(
        source=p.source, family=p.family, info=p.info, quantization=p.quantization, dtype=p.dtype,
    )
    try:
        final = mtp_folder.write_mtp_folder(model_dir, config, weights, force=force)
    except mtp_folder.MTPFolderError as e:
        raise AddMTPError(str(e)) from e
    except OSError as e:
        raise AddMTPError(f"cannot write {model_dir / mtp_folder.FOLDER}: {e.strerror or e}; "
                          "nothing written") from e
    with contextlib.suppress(OSError):  # the folder is whole; only its mode is not as wished
        os.chmod(final, 0o755)  # the model folder's readers need it, whatever the umask
    return final


def _unwritable(model_dir: Path) -> Optional[str]:
    """Why MODEL does not take the staging folder of a write (None: it does)."""
    try:
        mtp_folder.check_writable(model_dir)
    except OSError as e:
        return f"cannot write to {model_dir}: {e.strerror or e}"
    return None


def _recover(model_dir: Path, dry_run: bool, echo: Echo) -> None:
    """Finish what a killed earlier run left (`mtp_folder.recover_swap`)."""
    try:
        notes = mtp_folder.recover_swap(model_dir, dry_run=dry_run)
    except OSError as e:
        raise AddMTPError(f"cannot repair what an interrupted run left in {model_dir}: "
                          f"{e.strerror or e}") from e
    for line in notes:
        echo(line)


def preflight(model_dir: Path, source: str, *, bits, group_size, mode, revision, dry_run: bool,
              echo: Echo) -> Tuple[QuantRequest, Optional[str]]:
    """Every check that needs no conversion, before any: the folder, the options, whether the
    folder takes a write (why not, or None); then the repair of an interrupted earlier run."""
    if not model_dir.is_dir():
        raise AddMTPError(f"--model {model_dir} is not a local folder")
    target_config, _ = read_target_config(model_dir)
    local_source(source, revision)
    req = quant_request(target_config, bits, group_size, mode)
    unwritable = _unwritable(model_dir)
    if unwritable is None:
        _recover(model_dir, dry_run, echo)
    return req, unwritable


def _broken_head(model_dir: Path, echo: Echo) -> bool:
    """Whether MODEL/mtp/ exists but is not a whole head (the loader finds no head there);
    says so: it is replaced as if missing."""
    folder = model_dir / mtp_folder.FOLDER
    problem = mtp_folder.folder_problem(folder) if os.path.lexists(folder) else None
    if problem:
        echo(f"{folder} is incomplete or unreadable ({problem}): it will be replaced")
    return bool(problem)


def add_mtp_weights(model_dir, source: str, *, bits="auto", group_size="auto", mode="auto",
                    dry_run: bool = False, force: bool = False, revision: Optional[str] = None,
                    progress: bool = True, echo: Echo = print) -> Optional[Path]:
    """Returns the written `mtp/` folder, or None (dry run / head already there)."""
    model_dir = Path(model_dir)
    req, unwritable = preflight(model_dir, source, bits=bits, group_size=group_size, mode=mode,
                                revision=revision, dry_run=dry_run, echo=echo)
    existing = existing_head(model_dir)
    if existing and not force:
        echo(f"{model_dir} already has an MTP head ({existing}); nothing to do (--force replaces it).")
        return None
    if unwritable and not dry_run:
        raise AddMTPError(f"{unwritable}; nothing written")
    if unwritable:
        echo(f"warning: {unwritable}; a run without --dry-run would fail")
    replace = _broken_head(model_dir, echo) or force
    target = load_target(model_dir)
    p = plan(model_dir, source, download=not dry_run, revision=revision, progress=progress)
    echo(p.describe())
    validate(p, target)  # before the quantization: that builds a head of the source's shape
    choose_quantization(p, target, req)
    echo("\n".join(p.choice))
    if dry_run:
        if not p.tensors:
            echo("(dry run: source shards not local, tensor shapes and dtypes not checked)")
        echo(f"dry run: would write {model_dir / mtp_folder.FOLDER}; nothing written.")
        return None
    echo(f"converting on the CPU, one tensor at a time ({len(p.jobs)} tensors)...")
    weights = convert(p, echo=echo)
    check_loads(p, target, weights)
    final = write(p, weights, force=replace)
    size = sum(v.nbytes for v in weights.values())
    echo(f"wrote {final} ({size / 2**20:.1f} MiB); the model's own shards are unchanged.")
    return final
