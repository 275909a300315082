"""Repair a quantized MLX model folder that lost its MTP head (`mlxmtp add-mtp-weights`).

plan      -> which source shards hold `mtp.*`, what the head becomes, how it is quantized;
validate  -> source config / tensor shapes / dtypes / norms against the target, refuse mismatches;
convert   -> HF `mtp.*` -> MTPHead parameters (as `hf_head.convert_hf_head`: +1 norm shift once,
             experts stacked or split), quantized like the target, on the CPU, one tensor
             (and at most CHUNK_BYTES of source) at a time;
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
import numpy as np

from . import hf_head, mtp_folder

# Source bytes read per step when stacking / slicing experts (bounded memory).
CHUNK_BYTES = 64 << 20

# mlx-lm's defaults per quantization mode (utils.quantize_model: defaults_for_mode).
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}

_ST_DTYPES = {
    "BF16": (np.uint16, mx.bfloat16, "bfloat16"),
    "F16": (np.float16, mx.float16, "float16"),
    "F32": (np.float32, mx.float32, "float32"),
}
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
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return env or bool(constants.HF_HUB_OFFLINE)


def _snapshot(repo_id: str, patterns: List[str], revision: Optional[str], progress: bool) -> Path:
    from huggingface_hub import snapshot_download

    kwargs = dict(revision=revision, allow_patterns=patterns, local_files_only=_hf_offline())
    if os.environ.get("HF_HUB_CACHE"):  # read at call time (huggingface_hub reads it at import)
        kwargs["cache_dir"] = os.environ["HF_HUB_CACHE"]
    if progress:
        from tqdm.auto import tqdm

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
# Safetensors reader: headers without data, and slices along the first axis
# ---------------------------------------------------------------------------


class TensorReader:
    """Reads tensors (or expert ranges of them) straight from safetensors files with plain
    file reads: no mmap (whose touched pages would count as resident), nothing else loaded."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._headers: Dict[str, Tuple[dict, int]] = {}

    def header(self, shard: str) -> Tuple[dict, int]:
        if shard not in self._headers:
            with open(self.folder / shard, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            self._headers[shard] = (header, 8 + n)
        return self._headers[shard]

    def info(self, shard: str, name: str) -> dict:
        header, _ = self.header(shard)
        if name not in header:
            raise AddMTPError(f"{name} is listed in the index under {shard} but is not in that file")
        return header[name]

    def read(self, shard: str, name: str, start: int = 0, stop: Optional[int] = None) -> mx.array:
        header, base = self.header(shard)
        meta = header[name]
        if meta["dtype"] not in _ST_DTYPES:
            raise AddMTPError(f"{name}: unsupported dtype {meta['dtype']}")
        np_dtype, mx_dtype, _ = _ST_DTYPES[meta["dtype"]]
        shape = list(meta["shape"])
        stop = shape[0] if stop is None else stop
        row = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(np_dtype).itemsize if shape else 0
        begin = base + meta["data_offsets"][0]
        with open(self.folder / shard, "rb") as f:
            if shape:
                f.seek(begin + start * row)
                buf = f.read((stop - start) * row)
                arr = np.frombuffer(buf, dtype=np_dtype).reshape([stop - start] + shape[1:])
            else:
                f.seek(begin)
                arr = np.frombuffer(f.read(np.dtype(np_dtype).itemsize), dtype=np_dtype).reshape(())
        out = mx.array(arr)  # copies
        del arr
        return out.view(mx_dtype) if mx_dtype == mx.bfloat16 else out


# ---------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------


@dataclass
class Job:
    """One MTPHead parameter and how to build it from source tensors."""

    out: str  # MTPHead parameter name, e.g. "layers.0.mlp.switch_mlp.gate_proj.weight"
    kind: str  # copy | norm | stack | gate_half | up_half
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
        return sum(int(np.prod(t["shape"], dtype=np.int64)) * _itemsize(t["dtype"]) for t in self.tensors.values())

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


def _itemsize(st_dtype: str) -> int:
    return np.dtype(_ST_DTYPES[st_dtype][0]).itemsize if st_dtype in _ST_DTYPES else 0


def _text(config: dict) -> dict:
    return config.get("text_config", config)


def existing_head(model_dir: Path) -> Optional[str]:
    model_dir = Path(model_dir)
    if (model_dir / mtp_folder.FOLDER).exists():
        return f"{model_dir / mtp_folder.FOLDER} exists"
    files = hf_head.mtp_tensor_files(model_dir)
    if files:
        return f"its own safetensors hold {len(files)} mtp.* tensors ({', '.join(sorted(set(files.values())))})"
    return None


def make_jobs(files: Dict[str, str]) -> Tuple[List[Job], dict]:
    """Jobs (without shapes) turning HF `mtp.*` names into MTPHead names, like convert_hf_head."""
    names = sorted(files)
    layout = hf_head.expert_layout(names)
    jobs: List[Job] = []
    stacks: Dict[Tuple[int, str], Dict[int, str]] = {}
    for full in names:
        name = full.removeprefix(hf_head.MTP_PREFIX)
        if m := hf_head._PER_EXPERT.match(name):
            stacks.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = full
        elif m := hf_head._FUSED.match(name):
            prefix = f"layers.{m.group(1)}.mlp.switch_mlp"
            if m.group(2) == "gate_up_proj":
                jobs.append(Job(f"{prefix}.gate_proj.weight", "gate_half", [full], ()))
                jobs.append(Job(f"{prefix}.up_proj.weight", "up_half", [full], ()))
            else:
                jobs.append(Job(f"{prefix}.down_proj.weight", "copy", [full], ()))
        elif hf_head.is_zero_centred_norm(name):
            jobs.append(Job(name, "norm", [full], ()))
        else:
            jobs.append(Job(name, "copy", [full], ()))
    n_experts = 0
    for (layer, proj), experts in sorted(stacks.items()):
        n = len(experts)
        if sorted(experts) != list(range(n)):
            raise AddMTPError(f"source layer {layer} {proj}: expert indices are not 0..{n - 1}")
        if n_experts and n != n_experts:
            raise AddMTPError(f"source layer {layer} {proj} has {n} experts, other projections {n_experts}")
        n_experts = n
        jobs.append(Job(f"layers.{layer}.mlp.switch_mlp.{proj}.weight", "stack",
                        [experts[e] for e in range(n)], ()))
    info = {
        "expert_layout": layout,
        "num_experts": n_experts,
        "num_layers": hf_head.num_head_layers(names),
        "moe": any(j.out.endswith("mlp.gate.weight") for j in jobs),
    }
    return jobs, info


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
    if not (model_dir / "config.json").exists():
        raise AddMTPError(f"{model_dir} is not an MLX model folder (no config.json)")
    target_config = json.loads((model_dir / "config.json").read_text())
    from ..models.family import UnsupportedModelError, family_of

    try:
        family = family_of(target_config)
    except UnsupportedModelError as e:
        raise AddMTPError(f"target: {e}") from e
    source_dir, files = fetch_source(source, shards=download, revision=revision, progress=progress)
    source_config = json.loads((source_dir / "config.json").read_text()) \
        if (source_dir / "config.json").exists() else {}
    if not files:
        raise AddMTPError(f"source {source} has no mtp.* tensors (its index / safetensors list none): "
                          "use the original BF16 checkpoint, not a converted one")
    p = Plan(model_dir, source, source_dir, source_config, target_config, family, files,
             existing=existing_head(model_dir))
    p.jobs, p.info = make_jobs(files)
    reader = TensorReader(source_dir)
    if all((source_dir / s).exists() for s in p.shards):
        p.tensors = {n: reader.info(s, n) for n, s in files.items()}
        for job in p.jobs:
            job.shape = _job_shape(job, p.tensors)
        if p.info["expert_layout"] == "fused":
            p.info["num_experts"] = next(j.shape[0] for j in p.jobs if j.kind == "gate_half")
        dtypes = {t["dtype"] for t in p.tensors.values()}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _ST_DTYPES:
            raise AddMTPError(f"source mtp.* tensors have dtypes {sorted(dtypes)}; expected one float dtype")
        p.dtype = _ST_DTYPES[next(iter(dtypes))][2]
    if target is None:
        target = load_target(model_dir)
    choose_quantization(p, target, bits=bits, group_size=group_size, mode=mode)
    return p


def load_target(model_dir: Path):
    """The target model, lazily (nothing but headers read), to compare shapes against."""
    from mlx_lm.utils import load_model

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
    from ..models.family import text_parts

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


def head_skeleton(target, info: dict):
    from ..models.family import text_parts
    from ..models.mtp_head import MTPHead

    with cpu():
        return MTPHead(text_parts(target), num_layers=max(1, info["num_layers"]), moe=info["moe"])


def choose_quantization(p: Plan, target, *, bits="auto", group_size="auto", mode="auto") -> None:
    tq = p.target_config.get("quantization") or _text(p.target_config).get("quantization")
    want_bits = _parse_bits(bits)
    if mode in (None, "auto"):
        mode = (tq or {}).get("mode", "affine")
    if mode not in MODE_DEFAULTS:
        raise AddMTPError(f"--mode must be auto or one of {sorted(MODE_DEFAULTS)} (got {mode})")
    origin = "target config" if tq else "target is unquantized"
    if want_bits is None:
        want_bits = int(tq["bits"]) if tq else 16
    if group_size in (None, "auto"):
        gs = int(tq["group_size"]) if tq and "group_size" in tq else MODE_DEFAULTS[mode][0]
    else:
        gs = int(group_size)
    if want_bits == 16:
        p.quantization = None
        for job in p.jobs:
            job.quant = None
        p.choice = [f"quantization: none, head kept in the source dtype {p.dtype} (--bits 16 / {origin})"]
        return
    default = {"group_size": gs, "bits": want_bits, "mode": mode}
    target_default = (
        {"group_size": int(tq.get("group_size", 64)), "bits": int(tq["bits"]), "mode": tq.get("mode", "affine")}
        if tq else None
    )
    treatment = target_treatment(target) if tq else {}
    # Suffixes the target's config names per path (mlx-lm records its router / shared_expert_gate
    # overrides even when they equal the default): record them for the head too.
    named = {mm.group(1) for k, v in (tq or {}).items()
             if isinstance(v, dict) and (mm := _LAYER_SUFFIX.search(k))}
    skeleton = head_skeleton(target, p.info)
    quantizable = {path for path, m in skeleton.named_modules()
                   if hasattr(m, "to_quantized") and not isinstance(m, nn.Embedding)}
    quant: dict = dict(default)
    overrides, skipped, mirrored_plain = [], [], []
    for job in p.jobs:
        job.quant = None
        path = job.out.removesuffix(".weight")
        if not job.out.endswith(".weight") or path not in quantizable:
            continue
        params = default
        mm = _LAYER_SUFFIX.search(path)
        if mm and mm.group(1) in treatment:
            t = treatment[mm.group(1)]
            if t is None:  # the target kept its main layers' equivalent unquantized
                mirrored_plain.append(path)
                continue
            if t != target_default:  # a per-path override in the target (router, shared_expert_gate)
                params = t
        in_dim = job.shape[-1] if job.shape else 0
        if in_dim % params["group_size"] != 0:  # mlx-lm leaves these unquantized too
            skipped.append(f"{path} (input dim {in_dim})")
            continue
        job.quant = dict(params)
        if params != default or (mm and mm.group(1) in named):
            quant[path] = dict(params)
            overrides.append(f"{path} {params['bits']}-bit group {params['group_size']} {params['mode']}")
    p.quantization = quant
    src = "--bits" if bits not in (None, "auto") else origin
    p.choice = [f"quantization: {want_bits}-bit, group size {gs}, mode {mode} ({src}); "
                f"scales in the source dtype {p.dtype}"]
    if overrides:
        p.choice.append("  like the target's main layers: " + "; ".join(overrides))
    if mirrored_plain:
        p.choice.append("  unquantized like the target's main layers: " + ", ".join(mirrored_plain))
    if skipped:
        p.choice.append(f"  unquantized, not divisible by the group size: {', '.join(skipped)}")


# ---------------------------------------------------------------------------
# Validate
# ---------------------------------------------------------------------------


def validate(p: Plan, target) -> None:
    """Refuse anything that would give a head of another model; raises AddMTPError."""
    from mlx.utils import tree_flatten

    from ..models.family import family_of, text_parts

    problems: List[str] = []
    if p.source_config:
        try:
            src_family = family_of(p.source_config)
        except ValueError as e:
            src_family = None
            problems.append(f"source: {e}")
        if src_family and src_family != p.family:
            problems.append(f"source is a {src_family} checkpoint, target a {p.family} model")
        s, t = _text(p.source_config), _text(p.target_config)
        for k in _CONFIG_FIELDS:
            if k in s and k in t and s[k] != t[k]:
                problems.append(f"{k}: source {s[k]}, target {t[k]}")
    parts = text_parts(target)
    args = parts.args
    vocab = parts.embed_tokens.weight.shape[0]
    src_vocab = _text(p.source_config).get("vocab_size")
    if src_vocab is not None and src_vocab != vocab:
        problems.append(f"vocabulary: source {src_vocab}, target embedding has {vocab} rows")
    target_moe = int(getattr(args, "num_experts", 0) or 0) > 0
    if p.info["moe"] != target_moe:
        problems.append(f"source head is {'MoE' if p.info['moe'] else 'dense'}, target model "
                        f"{'MoE' if target_moe else 'dense'}")
    elif target_moe and p.info["num_experts"] and p.info["num_experts"] != args.num_experts:
        problems.append(f"expert count: source head has {p.info['num_experts']} experts, target model "
                        f"{args.num_experts} (a pruned model needs a head pruned the same way)")
    if p.tensors and not problems:
        expected = {k: tuple(v.shape) for k, v in tree_flatten(head_skeleton(target, p.info).parameters())}
        got = {j.out: tuple(j.shape) for j in p.jobs}
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = [f"{k}: source {got[k]}, target expects {expected[k]}"
                 for k in sorted(set(got) & set(expected)) if got[k] != expected[k]]
        if missing:
            problems.append(f"source head lacks {missing[:5]}")
        if extra:
            problems.append(f"source head has tensors the target's layer has no place for: {extra[:5]}")
        problems += wrong[:5]
        target_dtype = parts.backbone.norm.weight.dtype
        if p.dtype and getattr(mx, p.dtype) != target_dtype:
            problems.append(f"dtype: source head is {p.dtype}, target model {str(target_dtype).split('.')[-1]}")
    if p.tensors and not problems:
        problems += _norm_problems(p, parts)
    if problems:
        raise AddMTPError("source head does not fit the target model, nothing written:\n  - "
                          + "\n  - ".join(problems))


def _norm_problems(p: Plan, parts) -> List[str]:
    """The same rule as `load.check_norm_convention`, before writing: after our +1 the head's
    norms must sit near the target's (already shifted) final norm, not ~1 above it."""
    ref = parts.backbone.norm.weight.astype(mx.float32).mean().item()
    reader = TensorReader(p.source_dir)
    out = []
    with cpu():
        for job in p.jobs:
            if job.kind != "norm":
                continue
            src = job.sources[0]
            w = reader.read(p.files[src], src).astype(mx.float32)
            diff = (w + 1.0).mean().item() - ref
            if abs(diff) > 0.6 and abs(abs(diff) - 1.0) < 0.4:
                kind = "already shifted (norms ~1-centred: converted or double-shifted)" if diff > 0 \
                    else "shifted the wrong way"
                out.append(f"source norm {src} looks {kind}: mean {w.mean().item():.2f}, expected ~0 "
                           f"(HF zero-centred form)")
    return out


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
    if job.kind == "stack":
        n = len(job.sources)
        per = tensors[job.sources[0]]
        one = int(np.prod(per["shape"], dtype=np.int64)) * _itemsize(per["dtype"])
    elif len(job.shape) == 3:
        meta = tensors[job.sources[0]]
        n = meta["shape"][0]
        one = int(np.prod(meta["shape"][1:], dtype=np.int64)) * _itemsize(meta["dtype"])
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
    if job.kind == "norm":
        return w + 1.0  # zero-centred RMSNorm: +1 exactly once (as hf_head / mlx-lm sanitize)
    if job.kind in ("gate_half", "up_half"):
        mid = w.shape[-2] // 2
        return w[..., :mid, :] if job.kind == "gate_half" else w[..., mid:, :]
    return w


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
    from ..models.family import text_parts
    from ..models.load import MTPLoadError, build_head, check_norm_convention

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
