"""Repair a quantized MLX model folder that lost its MTP head (`mlxmtp add-mtp-weights`).

plan      -> which source shards hold `mtp.*`, what the head becomes, how it is quantized;
validate  -> source config / tensor shapes / dtypes / norms against the target, refuse mismatches;
convert   -> HF `mtp.*` -> MTPHead parameters (the mapping of `checkpoint.hf_head`: +1 norm
             shift once, experts stacked or split), quantized like the target, on the CPU,
             one tensor (and at most CHUNK_BYTES of source) at a time;
write     -> `mtp_folder.write_mtp_folder` (temporary folder, then one rename).

The model's own shards are never touched: the head lives in `MODEL_DIR/mtp/`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from huggingface_hub import constants as hf_constants
from huggingface_hub import snapshot_download
from mlx.utils import tree_flatten
from tqdm.auto import tqdm

from ..checkpoint import hf_head, mtp_folder
from ..checkpoint.tensor_files import ST_DTYPES, TensorFileError, TensorReader, nbytes
from ..mlxlm.family import UnsupportedModelError, family_of, text_config, text_parts
from ..mlxlm.loading import load_model
from ..models.load import MTPLoadError, build_head, check_norm_convention
from ..models.mtp_head import MTPHead

# Source bytes read per step when stacking / slicing experts (bounded memory).
CHUNK_BYTES = 64 << 20

# mlx-lm's defaults per quantization mode (utils.quantize_model: defaults_for_mode).
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}

# Config fields that must agree between source and target (text config level).
_CONFIG_FIELDS = (
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "intermediate_size",
)


class AddMTPError(ValueError):
    """Refused: the message says why; nothing was written."""


Echo = Callable[[str], None]


# ---------------------------------------------------------------------------
# Source: local folder or HF id, only the shards holding the head
# ---------------------------------------------------------------------------


def _hf_offline() -> bool:
    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return env or bool(hf_constants.HF_HUB_OFFLINE)


def _snapshot(repo_id: str, patterns: List[str], revision: Optional[str], progress: bool) -> Path:
    kwargs = dict(revision=revision, allow_patterns=patterns, local_files_only=_hf_offline())
    if os.environ.get("HF_HUB_CACHE"):  # read at call time (huggingface_hub reads it at import)
        kwargs["cache_dir"] = os.environ["HF_HUB_CACHE"]
    if progress:
        kwargs["tqdm_class"] = tqdm
    try:
        return Path(snapshot_download(repo_id, **kwargs))
    except Exception as e:  # network / cache / auth errors: one clear message
        raise AddMTPError(f"could not fetch {patterns} of {repo_id!r} from Hugging Face: {e}") from e


def fetch_source(source: str, *, shards: bool = True, revision: Optional[str] = None,
                 progress: bool = True) -> Tuple[Path, Dict[str, str]]:
    """(folder, {mtp tensor: shard}). An HF id downloads config + index, then (if `shards`)
    only the shards that hold `mtp.*` tensors."""
    p = Path(source).expanduser()
    if p.is_dir():
        files = hf_head.mtp_tensor_files(p)
        return p, files
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
    model_dir = Path(model_dir)
    if (model_dir / mtp_folder.FOLDER).exists():
        return f"{model_dir / mtp_folder.FOLDER} exists"
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


def _parse_bits(bits) -> Optional[int]:
    if bits in (None, "auto"):
        return None
    b = int(bits)
    if b not in (2, 3, 4, 5, 6, 8, 16):
        raise AddMTPError(f"--bits must be auto, 2, 3, 4, 5, 6, 8 or 16 (got {bits})")
    return b


def plan(model_dir, source: str, *, bits="auto", group_size="auto", mode="auto",
         download: bool = True, revision: Optional[str] = None, progress: bool = True,
         target=None) -> Plan:
    """Read configs and headers (no tensor data) and decide everything. `target` is the
    lazily loaded target model (loaded here when None)."""
    model_dir = Path(model_dir)
    target_config, family = _target_config(model_dir)
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
    if target is None:
        target = load_target(model_dir)
    choose_quantization(p, target, bits=bits, group_size=group_size, mode=mode)
    return p


def _target_config(model_dir: Path) -> Tuple[dict, str]:
    """(config, family) of the MLX model folder to repair."""
    if not (model_dir / "config.json").exists():
        raise AddMTPError(f"{model_dir} is not an MLX model folder (no config.json)")
    config = json.loads((model_dir / "config.json").read_text())
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


def load_target(model_dir: Path):
    """The target model, lazily (nothing but headers read), to compare shapes against."""
    with cpu():
        model, _ = load_model(Path(model_dir), lazy=True)
    return model


# ---------------------------------------------------------------------------
# Quantization: like the target
# ---------------------------------------------------------------------------

_LAYER_SUFFIX = re.compile(r"(?:^|\.)layers\.\d+\.(.+)$")


def _module_quant(m) -> Optional[dict]:
    if hasattr(m, "bits") and hasattr(m, "group_size") and hasattr(m, "scales"):
        return {"group_size": int(m.group_size), "bits": int(m.bits), "mode": getattr(m, "mode", "affine")}
    return None


def target_treatment(target) -> Dict[str, Optional[dict]]:
    """How the target's main layers are quantized, per layer-relative path (e.g. "mlp.gate"
    -> {"bits": 8, "group_size": 64, "mode": "affine"}, or None for left unquantized):
    the most common treatment over all layers."""
    seen: Dict[str, Counter] = {}
    for path, m in text_parts(target).backbone.named_modules():
        mm = _LAYER_SUFFIX.search(path)
        if not mm or not (hasattr(m, "to_quantized") or _module_quant(m)) or isinstance(m, nn.Embedding):
            continue
        q = _module_quant(m)
        key = None if q is None else tuple(sorted(q.items()))
        seen.setdefault(mm.group(1), Counter())[key] += 1
    return {s: (None if c.most_common(1)[0][0] is None else dict(c.most_common(1)[0][0]))
            for s, c in seen.items()}


def head_skeleton(target, info: dict) -> MTPHead:
    """An MTPHead for the target, of the source head's shape (lazy: no weights)."""
    with cpu():
        return MTPHead(text_parts(target), num_layers=max(1, info["num_layers"]), moe=info["moe"])


@dataclass
class QuantRequest:
    """The head's quantization as the options ask for it, `auto` resolved from the target."""

    bits: int  # 16: none
    group_size: int
    mode: str
    target: Optional[dict]  # the target config's quantization; None for an unquantized target

    @property
    def origin(self) -> str:
        return "target config" if self.target else "target is unquantized"


def quant_request(target_config: dict, bits="auto", group_size="auto", mode="auto") -> QuantRequest:
    tq = target_config.get("quantization") or text_config(target_config).get("quantization")
    want_bits = _parse_bits(bits)
    if mode in (None, "auto"):
        mode = (tq or {}).get("mode", "affine")
    if mode not in MODE_DEFAULTS:
        raise AddMTPError(f"--mode must be auto or one of {sorted(MODE_DEFAULTS)} (got {mode})")
    if want_bits is None:
        want_bits = int(tq["bits"]) if tq else 16
    if group_size in (None, "auto"):
        gs = int(tq["group_size"]) if tq and "group_size" in tq else MODE_DEFAULTS[mode][0]
    else:
        gs = int(group_size)
    return QuantRequest(want_bits, gs, mode, tq)


def choose_quantization(p: Plan, target, *, bits="auto", group_size="auto", mode="auto") -> None:
    """Each job's quantization and the head's (mlx-lm style) quantization dict: as asked,
    `auto` like the target, each path treated as the target's main layers treat it."""
    req = quant_request(p.target_config, bits, group_size, mode)
    for job in p.jobs:
        job.quant = None
    if req.bits == 16:
        p.quantization = None
        p.choice = [f"quantization: none, head kept in the source dtype {p.dtype} (--bits 16 / {req.origin})"]
        return
    default = {"group_size": req.group_size, "bits": req.bits, "mode": req.mode}
    p.quantization, notes = _quantize_jobs(p, target, default, req.target)
    src = "--bits" if bits not in (None, "auto") else req.origin
    p.choice = [f"quantization: {req.bits}-bit, group size {req.group_size}, mode {req.mode} ({src}); "
                f"scales in the source dtype {p.dtype}"] + notes


def _quantize_jobs(p: Plan, target, default: dict, tq: Optional[dict]) -> Tuple[dict, List[str]]:
    """Set each quantizable job's quantization; (the head's quantization dict, lines on
    the paths treated otherwise than `default`)."""
    treatment = target_treatment(target) if tq else {}
    target_default = _config_default(tq)
    # Suffixes the target's config names per path (mlx-lm records its router / shared_expert_gate
    # overrides even when they equal the default): record them for the head too.
    named = {mm.group(1) for k, v in (tq or {}).items()
             if isinstance(v, dict) and (mm := _LAYER_SUFFIX.search(k))}
    quantizable = {path for path, m in head_skeleton(target, p.info).named_modules()
                   if hasattr(m, "to_quantized") and not isinstance(m, nn.Embedding)}
    quant: dict = dict(default)
    overrides, skipped, mirrored_plain = [], [], []
    for job in p.jobs:
        path = job.out.removesuffix(".weight")
        if not job.out.endswith(".weight") or path not in quantizable:
            continue
        mm = _LAYER_SUFFIX.search(path)
        suffix = mm.group(1) if mm else None
        params = _like_target(suffix, default, treatment, target_default)
        if params is None:  # the target kept its main layers' equivalent unquantized
            mirrored_plain.append(path)
            continue
        in_dim = job.shape[-1] if job.shape else 0
        if in_dim % params["group_size"] != 0:  # mlx-lm leaves these unquantized too
            skipped.append(f"{path} (input dim {in_dim})")
            continue
        job.quant = dict(params)
        if params != default or suffix in named:
            quant[path] = dict(params)
            overrides.append(f"{path} {params['bits']}-bit group {params['group_size']} {params['mode']}")
    return quant, _quantization_notes(overrides, mirrored_plain, skipped)


def _config_default(tq: Optional[dict]) -> Optional[dict]:
    """The target config's default quantization, in the form of `_module_quant`."""
    if not tq:
        return None
    return {"group_size": int(tq.get("group_size", 64)), "bits": int(tq["bits"]), "mode": tq.get("mode", "affine")}


def _like_target(suffix: Optional[str], default: dict, treatment: Dict[str, Optional[dict]],
                 target_default: Optional[dict]) -> Optional[dict]:
    """A head path's quantization: the target's per-path override where its main layers have
    one (router, shared_expert_gate), None where they are unquantized, else `default`."""
    if suffix not in treatment:
        return default
    t = treatment[suffix]
    if t is None:
        return None
    return default if t == target_default else t


def _quantization_notes(overrides: List[str], mirrored_plain: List[str], skipped: List[str]) -> List[str]:
    notes = []
    if overrides:
        notes.append("  like the target's main layers: " + "; ".join(overrides))
    if mirrored_plain:
        notes.append("  unquantized like the target's main layers: " + ", ".join(mirrored_plain))
    if skipped:
        notes.append(f"  unquantized, not divisible by the group size: {', '.join(skipped)}")
    return notes


# ---------------------------------------------------------------------------
# Validate
# ---------------------------------------------------------------------------


def validate(p: Plan, target) -> None:
    """Refuse anything that would give a head of another model; raises AddMTPError."""
    parts = text_parts(target)
    problems = _config_problems(p) + _architecture_problems(p, parts)
    if p.tensors and not problems:
        problems += _shape_problems(p, target, parts)
    if p.tensors and not problems:
        problems += _norm_problems(p, parts)
    if problems:
        raise AddMTPError("source head does not fit the target model, nothing written:\n  - "
                          + "\n  - ".join(problems))


def _config_problems(p: Plan) -> List[str]:
    """Source and target configs: same family, same sizes."""
    if not p.source_config:
        return []
    problems: List[str] = []
    try:
        src_family = family_of(p.source_config)
    except ValueError as e:
        src_family = None
        problems.append(f"source: {e}")
    if src_family and src_family != p.family:
        problems.append(f"source is a {src_family} checkpoint, target a {p.family} model")
    s, t = text_config(p.source_config), text_config(p.target_config)
    problems += [f"{k}: source {s[k]}, target {t[k]}" for k in _CONFIG_FIELDS
                 if k in s and k in t and s[k] != t[k]]
    return problems


def _architecture_problems(p: Plan, parts) -> List[str]:
    """The source against the loaded target: vocabulary, MoE or dense, expert count."""
    problems: List[str] = []
    args = parts.args
    vocab = parts.embed_tokens.weight.shape[0]
    src_vocab = text_config(p.source_config).get("vocab_size")
    if src_vocab is not None and src_vocab != vocab:
        problems.append(f"vocabulary: source {src_vocab}, target embedding has {vocab} rows")
    target_moe = int(getattr(args, "num_experts", 0) or 0) > 0
    if p.info["moe"] != target_moe:
        problems.append(f"source head is {'MoE' if p.info['moe'] else 'dense'}, target model "
                        f"{'MoE' if target_moe else 'dense'}")
    elif target_moe and p.info["num_experts"] and p.info["num_experts"] != args.num_experts:
        problems.append(f"expert count: source head has {p.info['num_experts']} experts, target model "
                        f"{args.num_experts} (a pruned model needs a head pruned the same way)")
    return problems


def _shape_problems(p: Plan, target, parts) -> List[str]:
    """Every head parameter present, of the shape and dtype the target's layers have."""
    problems: List[str] = []
    expected = {k: tuple(v.shape) for k, v in tree_flatten(head_skeleton(target, p.info).parameters())}
    got = {j.out: tuple(j.shape) for j in p.jobs}
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing:
        problems.append(f"source head lacks {missing[:5]}")
    if extra:
        problems.append(f"source head has tensors the target's layer has no place for: {extra[:5]}")
    problems += [f"{k}: source {got[k]}, target expects {expected[k]}"
                 for k in sorted(set(got) & set(expected)) if got[k] != expected[k]][:5]
    target_dtype = parts.backbone.norm.weight.dtype
    if p.dtype and getattr(mx, p.dtype) != target_dtype:
        problems.append(f"dtype: source head is {p.dtype}, target model {str(target_dtype).split('.')[-1]}")
    return problems


def _norm_problems(p: Plan, parts) -> List[str]:
    """The rule of `load.check_norm_convention` (hf_head.misshifted_norms), before writing:
    after our +1 the head's norms must sit near the target's (already shifted) final norm."""
    with cpu():
        bad = list(hf_head.misshifted_norms(_source_norms(p), parts.backbone.norm.weight))
    return [f"source norm {n.name} looks "
            + ("already shifted (norms ~1-centred: converted or double-shifted)" if n.twice
               else "shifted the wrong way")
            + f": mean {n.mean - 1.0:.2f}, expected ~0 (HF zero-centred form)" for n in bad]


def _source_norms(p: Plan) -> Iterator[Tuple[str, mx.array]]:
    """(source name, effective weight) of each head norm, read one at a time."""
    reader = TensorReader(p.source_dir)
    for job in p.jobs:
        if job.kind == "norm":
            src = job.sources[0]
            yield src, hf_head.head_form("norm", reader.read(p.files[src], src).astype(mx.float32))


# ---------------------------------------------------------------------------
# Convert (CPU, one tensor at a time)
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def cpu() -> Iterator[None]:
    """Run on the CPU (a GPU may not take 512 experts at once), restoring the default after."""
    prev = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        with mx.stream(mx.cpu):
            yield
    finally:
        mx.set_default_device(prev)


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


# ---------------------------------------------------------------------------
# The whole command
# ---------------------------------------------------------------------------


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
    p = plan(model_dir, source, bits=bits, group_size=group_size, mode=mode, download=not dry_run,
             revision=revision, progress=progress, target=target)
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
