"""Repair a quantized MLX model folder that lost its MTP head (`mlxmtp add-mtp-weights`).

plan      -> which source shards hold `mtp.*`, what the head becomes (`plan.py`), how it is
             quantized (`quantization.py`);
validate  -> source config / tensor shapes / dtypes / norms against the target, refuse
             mismatches (`validation.py`);
convert   -> HF `mtp.*` -> MTPHead parameters (the mapping of `checkpoint.hf_head`: +1 norm
             shift once, experts stacked or split), quantized like the target, on the CPU,
             one tensor (and at most CHUNK_BYTES of source) at a time;
write     -> `mtp_folder.write_mtp_folder` (temporary folder, then one rename).

The model's own shards are never touched: the head lives in `MODEL_DIR/mtp/`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from ..checkpoint import hf_head, mtp_folder
from ..checkpoint.tensor_files import TensorReader, nbytes
from ..mlxlm.family import text_parts
from ..models.load import MTPLoadError, build_head, check_norm_convention
from .plan import AddMTPError, Echo, Job, Plan, existing_head, plan
from .quantization import choose_quantization
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
            head = build_head(text_parts(target), weights, p.info, p.quantization)
            check_norm_convention(text_parts(target), head)
        except MTPLoadError as e:
            raise AddMTPError(f"the converted head would not load: {e}") from e


def write(p: Plan, weights: Dict[str, mx.array], *, force: bool = False) -> Path:
    model_dir = p.model_dir
    for stale in list(model_dir.glob(".mtp-tmp-*")) + list(model_dir.glob(".mtp-old-*")):
        shutil.rmtree(stale, ignore_errors=True)  # left by a killed earlier run
    config = mtp_folder.make_head_config(
        source=p.source, family=p.family, info=p.info, quantization=p.quantization, dtype=p.dtype,
    )
    try:
        final = mtp_folder.write_mtp_folder(model_dir, config, weights, force=force)
    except mtp_folder.MTPFolderError as e:
        raise AddMTPError(str(e)) from e
    os.chmod(final, 0o755)  # mkdtemp made it private; the model folder's readers need it
    return final


def add_mtp_weights(model_dir, source: str, *, bits="auto", group_size="auto", mode="auto",
                    dry_run: bool = False, force: bool = False, revision: Optional[str] = None,
                    progress: bool = True, echo: Echo = print) -> Optional[Path]:
    """Returns the written `mtp/` folder, or None (dry run / head already there)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise AddMTPError(f"--model {model_dir} is not a local folder")
    existing = existing_head(model_dir) if (model_dir / "config.json").exists() else None
    if existing and not force:
        echo(f"{model_dir} already has an MTP head ({existing}); nothing to do (--force replaces it).")
        return None
    target = load_target(model_dir)
    p = plan(model_dir, source, download=not dry_run, revision=revision, progress=progress)
    choose_quantization(p, target, bits=bits, group_size=group_size, mode=mode)
    echo(p.describe())
    validate(p, target)
    if dry_run:
        if not p.tensors:
            echo("(dry run: source shards not local, tensor shapes and dtypes not checked)")
        echo(f"dry run: would write {model_dir / mtp_folder.FOLDER}; nothing written.")
        return None
    echo(f"converting on the CPU, one tensor at a time ({len(p.jobs)} tensors)...")
    weights = convert(p, echo=echo)
    check_loads(p, target, weights)
    final = write(p, weights, force=force)
    size = sum(v.nbytes for v in weights.values())
    echo(f"wrote {final} ({size / 2**20:.1f} MiB); the model's own shards are unchanged.")
    return final
