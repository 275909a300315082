"""Load an mlx-lm model with its MTP head.

mlx-lm loads the main model (and drops `mtp.*` in every `sanitize`); this module
finds the head's weights — in the HF checkpoint itself or in an injected `mtp/`
folder — builds an `MTPHead` from mlx-lm's own layer classes, and returns an `MTPModel`
holding the untouched mlx-lm model, the head and what the engine learns about them (the
model's parameter tree and logits stay exactly stock mlx-lm's).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from huggingface_hub import constants as hf_constants
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
from mlx.utils import tree_flatten, tree_map

from ..checkpoint import hf_head, mtp_folder, tensor_files
from ..checkpoint.token_list import DraftVocabError
from ..mlxlm import loading
from ..mlxlm.family import TextParts, family_of, text_config, text_parts
from . import demo, head_layouts
from .demo import demo_model_path
from .draft_vocab import DraftVocab, draft_token_ids
from .mtp_head import MTPHead

log = logging.getLogger("mlxmtp")

# The commands add how to run without the head where it is required (serve: drop --enable-mtp;
# generate: --disable-mtp), as the options differ; a head that is off already needs neither.
REPAIR_HINT = "Repair it with: mlxmtp add-mtp-weights --model {model} --source <BF16 HF checkpoint or repo id>."
HIDDEN_STATES = ("post_norm", "pre_norm")
HEAD_CONFIG_KEYS = ("expert_layout", "num_experts", "num_layers", "moe")  # the layout an mtp/config.json gives


class ModelLoadError(ValueError):
    """The model cannot be loaded (no such folder or repo, not a model, unreadable files);
    the message says which and why, in one line the CLIs print as is."""


class MTPLoadError(ModelLoadError):
    """The model has no usable MTP head; the message says why and how to repair it."""


class MissingMTPHeadError(MTPLoadError):
    pass


@dataclass
class HeadSource:
    location: str  # "hf_checkpoint" | "mtp_folder"
    path: Path
    tensors: Dict[str, str] = field(default_factory=dict)  # hf: tensor -> shard
    config: Optional[dict] = None  # mtp_folder: mtp/config.json


@dataclass
class MTPModel:
    """What `load` returns: the mlx-lm model (`base`, untouched), its MTP head (None when
    MTP is off, `disabled_reason` saying why) and the depth policies the engines of this
    model learn and share. Calls, and attributes it does not have, go to `base`: mlx-lm's
    own generation functions take an MTPModel as they take the model."""

    base: nn.Module
    parts: TextParts
    head: Optional[MTPHead]
    source: Optional[HeadSource]
    info: dict
    hidden_state: str = "post_norm"
    disabled_reason: Optional[str] = None
    policies: dict = field(default_factory=dict)  # learnt depth policies, shared by engines
    vocab: Optional[DraftVocab] = None  # embedding / lm_head as the drafter uses them
    compiled_head: Optional[object] = None  # engine.compiled_head.CompiledHead, made by the first engine asking
    model_dir: Optional[Path] = None  # the folder it was loaded from (generation_config.json, ...)

    @property
    def active(self) -> bool:
        return self.head is not None

    def __call__(self, *args, **kwargs):
        return self.base(*args, **kwargs)

    def __getattr__(self, name: str):
        base = self.__dict__.get("base")
        if base is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(base, name)


# Fetched with every model, whatever weight files a rank needs: configs, the tokenizer, and
# the head's own files (mlxmtp's mtp/ folder, other tools' sidecars: every rank holds the head).
CONFIG_FILES = ["*.json", "*.py", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt", f"{mtp_folder.FOLDER}/*",
                *hf_head.SIDECARS]


def resolve_model_path(path_or_hf_id: str, revision: Optional[str] = None,
                       weight_files: Optional[list] = None) -> Path:
    """A local folder as is, the demo's by its name `mlxmtp-demo`; otherwise a Hugging Face
    repo id through huggingface_hub (its cache makes a second load offline). `weight_files`:
    fetch only these weight files (a rank of a distributed run: distributed/load.py);
    default every one."""
    path_or_hf_id = demo.resolve(path_or_hf_id)
    p = Path(path_or_hf_id).expanduser()
    if p.exists():
        return p
    weights = ["*.safetensors"] if weight_files is None else list(weight_files)
    return hub_snapshot(path_or_hf_id, CONFIG_FILES + weights, revision)


def hub_snapshot(repo_id: str, patterns: list, revision: Optional[str] = None, tqdm_class=None) -> Path:
    """The files of a Hugging Face repo matching `patterns`, through huggingface_hub (the
    one place mlxmtp fetches; `tqdm_class`: its download bars, huggingface_hub's own by
    default). A name that is a path (no such folder here) or a fetch that fails is a
    ModelLoadError."""
    if _names_a_path(repo_id):
        raise ModelLoadError(f"no such model folder: {repo_id}")
    bars = {"tqdm_class": tqdm_class} if tqdm_class is not None else {}
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, **bars))
    except HFValidationError:
        raise ModelLoadError(f"{repo_id} is neither a model folder nor a Hugging Face repo id") from None
    except LocalEntryNotFoundError as e:
        raise ModelLoadError(f"cannot fetch {repo_id} from Hugging Face, and it is not in the local cache "
                             f"({str(e).strip().splitlines()[0]}); nor is it a folder here. "
                             + _fetch_hint(repo_id)) from e
    except (HfHubHTTPError, OSError, ValueError) as e:  # no such repo, no access, a disk error
        why = " ".join(str(e).split()) or type(e).__name__
        raise ModelLoadError(f"cannot fetch {repo_id} from Hugging Face: {why}; nor is it a folder here") from e


def _fetch_hint(repo_id: str) -> str:
    """What to do about a repo that is neither fetched nor cached: the network, or offline
    mode (HF_HUB_OFFLINE), stands in the way."""
    offline = getattr(hf_constants, "is_offline_mode", lambda: hf_constants.HF_HUB_OFFLINE)()
    if offline:
        return (f"Hugging Face's offline mode is on (HF_HUB_OFFLINE): fetch it once with `hf download {repo_id}` "
                "with the variable unset")
    return f"Check the network, or fetch it first with `hf download {repo_id}`"


def _names_a_path(name: str) -> bool:
    """Whether a missing model name can only be meant as a path: absolute, relative to
    `.` or `~`, more than one folder deep, or `owner/name` where a folder `owner` exists
    here (`models/qwen` beside the other models, not a repo of a user called models)."""
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return True
    return "/" in name and Path(name).parent.is_dir()


def check_model_folder(model_dir: Path, weights: bool = True) -> None:
    """Refuse, in one line, a folder mlx-lm could only fail on with a traceback (`weights`:
    one that must hold the weights, not only the configs and tokenizer)."""
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir} is not a folder: give a model folder or a Hugging Face repo id")
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} is not a model folder: it has no config.json")
    if weights and not any(model_dir.glob("*.safetensors")):
        raise ModelLoadError(f"{model_dir} is not a model folder: it has no *.safetensors weights")


def locate_head(model_dir: Path) -> Optional[HeadSource]:
    """Where the head's weights are, judged by the tensors present, never by the config
    (fine-tunes and most quantized conversions keep `mtp_num_hidden_layers` and drop the
    tensors): mlxmtp's own `mtp/` folder, else `mtp.*` tensors in the shards or a sidecar
    (a `mtp/` folder another tool wrote holds those)."""
    model_dir = Path(model_dir)
    problem = None
    if mtp_folder.has_mtp_folder(model_dir):
        folder = model_dir / mtp_folder.FOLDER
        try:
            config = json.loads((folder / mtp_folder.CONFIG).read_text())
            problem = mtp_folder.config_problem(config, HEAD_CONFIG_KEYS)
        except (OSError, ValueError) as e:
            problem = f"its {mtp_folder.CONFIG}: {e}"
        if problem is None:
            return HeadSource("mtp_folder", folder, config=config)
    try:
        files = hf_head.mtp_tensor_files(model_dir)
    except (OSError, ValueError) as e:  # a sidecar file whose header does not parse
        raise MTPLoadError(_unreadable_head(model_dir, str(e))) from e
    if files:
        return HeadSource("hf_checkpoint", model_dir, tensors=files)
    if problem is not None:
        raise MTPLoadError(_unreadable_head(model_dir, problem))
    return None


def _unreadable_head(model_dir: Path, why: str) -> str:
    return (f"the MTP head in {model_dir} cannot be read ({why}). Rebuild it with: mlxmtp add-mtp-weights "
            f"--model {model_dir} --source <BF16 HF checkpoint or repo id> --force")


def read_head(model_dir: Path, reference_norm: mx.array) -> Optional[tuple]:
    """(HeadSource, head_weights(...)) of the model's head, None when it has none; a head
    whose files cannot be read (cut short, another format) is an MTPLoadError."""
    source = locate_head(model_dir)
    if source is None:
        return None
    try:
        return source, head_weights(source, reference_norm)
    except (OSError, ValueError, RuntimeError, KeyError) as e:  # RuntimeError: MLX's safetensors reader
        raise MTPLoadError(_unreadable_head(model_dir, str(e))) from e


def head_weights(source: HeadSource, reference_norm: mx.array) -> tuple[Dict[str, mx.array], dict, Optional[dict]]:
    """(parameters in MTPHead naming, layout info, quantization) for a located head;
    `mtp.*` tensors' norms are shifted unless they were already (head_layouts.py: judged
    against `reference_norm`, the model's final norm weight)."""
    if source.location == "mtp_folder":
        config, weights = mtp_folder.read_mtp_folder(source.path.parent)
        info = {k: config[k] for k in HEAD_CONFIG_KEYS}
        return weights, info, config.get("quantization")
    tensors = hf_head.load_mtp_tensors(source.path, source.tensors)
    weights, info = head_layouts.convert_settling_norms(tensors, reference_norm)
    return weights, info, None


def quantize_like(module: nn.Module, quantization: dict, weights: Dict[str, mx.array]) -> None:
    """Make `module` quantized like the saved weights, as mlx-lm's loader does for a model:
    per-path overrides first, then every layer whose `scales` were saved."""

    def predicate(path, m):
        if path in quantization:
            return quantization[path]
        if not hasattr(m, "to_quantized"):
            return False
        return f"{path}.scales" in weights

    nn.quantize(
        module,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def build_head(parts: TextParts, weights: Dict[str, mx.array], info: dict,
               quantization: Optional[dict] = None) -> MTPHead:
    head = MTPHead(parts, num_layers=max(1, info["num_layers"]), moe=info["moe"])
    if not quantization:  # pre-quantized `mtp.*` tensors say how only by their widths
        try:
            quantization = head_layouts.infer_quantization(head, weights)
        except ValueError as e:
            raise MTPLoadError(f"{e}. Rebuild the head with mlxmtp add-mtp-weights --force.") from e
    if quantization:
        quantize_like(head, quantization, weights)
    expected = dict(tree_flatten(head.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(expected) & set(weights) if expected[k].shape != weights[k].shape)
    if missing or extra or wrong:
        details = []
        if missing:
            details.append(f"missing {missing[:5]}")
        if extra:
            details.append(f"unexpected {extra[:5]}")
        if wrong:
            k = wrong[0]
            details.append(
                f"{len(wrong)} shape mismatches, e.g. {k}: head has {tuple(weights[k].shape)}, "
                f"model expects {tuple(expected[k].shape)}"
            )
        raise MTPLoadError(
            "the MTP head does not match this model (" + "; ".join(details) + "). "
            "Was it taken from another model?"
        )
    head.load_weights(list(weights.items()), strict=True)
    head.eval()
    if not quantization and mx.default_device() == mx.cpu:
        # MLX's CPU kernels for float16/bfloat16 are slower than float32 (no BLAS), and the
        # head's steps are on the critical path of every cycle: compute it in float32 there.
        # (Drafts are always verified, so this can only change acceptance, never output.)
        head.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype in (mx.float16, mx.bfloat16) else a,
                             head.parameters()))
    # Materialise now: MLX streams are per thread, and a server evaluates on its engine thread.
    mx.eval(head.parameters())
    return head


def check_norm_convention(parts: TextParts, head: MTPHead) -> None:
    """Refuse double-shifted (or never-shifted) head norms (see hf_head.misshifted_norms)."""
    norms = ((name, w) for name, w in tree_flatten(head.parameters())
             if name.endswith("norm.weight") and w.ndim == 1)
    bad = next(hf_head.misshifted_norms(norms, parts.backbone.norm.weight), None)
    if bad is not None:
        raise MTPLoadError(
            f"MTP head norm {bad.name} looks {'shifted twice' if bad.twice else 'never shifted'} (mean "
            f"effective weight {bad.mean:.2f} vs {bad.reference:.2f} for the model's final norm): the +1 "
            "zero-centred RMSNorm shift must be applied exactly once. Rebuild the head with "
            "mlxmtp add-mtp-weights --force."
        )


def attach_mtp(model: nn.Module, model_dir: Path, *, hidden_state: str = "post_norm",
               required: bool = True, model_name: str = "", draft_vocab: int = 0,
               draft_vocab_file: Optional[Path] = None) -> MTPModel:
    """`model` with its head, as an MTPModel (a missing head raises MissingMTPHeadError when
    `required`, else gives an MTPModel with MTP off and the reason)."""
    if hidden_state not in HIDDEN_STATES:
        raise ValueError(f"hidden_state must be one of {HIDDEN_STATES}")
    parts = text_parts(model)
    try:  # a head that cannot be read or built: as a missing one where MTP may fall back
        found = read_head(model_dir, parts.backbone.norm.weight)
        if found is not None:
            source, (weights, info, quantization) = found
            head = build_head(parts, weights, info, quantization)
            check_norm_convention(parts, head)
    except MTPLoadError as e:
        if required:
            raise
        return MTPModel(model, parts, None, None, {}, hidden_state, disabled_reason=str(e))
    if found is None:
        reason = _missing_head(model_name or str(model_dir), Path(model_dir))
        if required:
            raise MissingMTPHeadError(reason)
        return MTPModel(model, parts, None, None, {}, hidden_state, disabled_reason=reason)
    quantized = bool(quantization) or any(k.endswith(".scales") for k in weights)
    vocab = _draft_vocab(parts, model_dir, draft_vocab, draft_vocab_file,
                         compute_dtype=None if quantized else head.fc.weight.dtype)
    return MTPModel(model, parts, head, source, info, hidden_state, vocab=vocab)


def _missing_head(name: str, model_dir: Path) -> str:
    """Why a model has no head, and the command that gives it one."""
    left = mtp_folder.interrupted_head(model_dir)
    if left is not None:  # the loader never moves it itself: model folders may be read-only caches
        return (f"{name} has no {mtp_folder.FOLDER}/ folder: an interrupted mlxmtp add-mtp-weights left the head "
                f"in {left}, which running it again puts in place. " + REPAIR_HINT.format(model=model_dir))
    return (f"{name} has no MTP head: no mtp.* tensors in its safetensors and no {mtp_folder.FOLDER}/ folder "
            "(quantized conversions usually drop it). " + REPAIR_HINT.format(model=model_dir))


def _draft_vocab(parts: TextParts, model_dir: Path, size: int, path: Optional[Path], compute_dtype) -> DraftVocab:
    """The drafter's vocabulary, trimmed to the token list when one is asked for (size > 0);
    an unusable list is an MTPLoadError (the CLIs turn it into a clean error)."""
    try:
        ids = draft_token_ids(parts, model_dir, size, path) if size else None
        vocab = DraftVocab(parts, compute_dtype=compute_dtype, token_ids=ids)
    except DraftVocabError as e:
        raise MTPLoadError(str(e)) from e
    if ids is not None:
        log.info("draft vocabulary: the MTP head drafts from %d of %d tokens", len(ids), vocab.full_size)
    return vocab


def load(path_or_hf_id=None, mtp: bool = True, *, mtp_fallback: bool = False,
         hidden_state: str = "post_norm", revision: Optional[str] = None, lazy: bool = False,
         draft_vocab: int = 0, draft_vocab_file=None, pipeline=None, chat_template: Optional[str] = None,
         adapter_path=None, trust_remote_code: bool = False, use_default_chat_template: bool = False):
    """(MTPModel, tokenizer): the model and tokenizer as mlx-lm loads them, with the MTP head.

    mtp=True: a missing head raises `MissingMTPHeadError` (naming the repair command)
    unless mtp_fallback, in which case the model loads without MTP and the reason is logged.
    draft_vocab=N (> 0): the head drafts only from the first N tokens of the model's token
    list (`mtp/draft_vocab.json`, or `draft_vocab_file`); vocabularies over 64K only.
    pipeline=(group, split, strict): load only this rank's layers of a pipeline split
    (distributed/load.py); the head and everything outside the layers load on every rank.
    chat_template: a Jinja template used instead of the tokenizer's own.
    trust_remote_code: let the tokenizer run code from the model's folder (as mlx-lm's server).
    use_default_chat_template: a tokenizer without a chat template takes its
    default_chat_template (as mlx-lm's server); without one either, a ModelLoadError.
    adapter_path: fine-tuned adapters (`mlx_lm.lora`) applied to the model as mlx-lm applies
    them; the head drafts for the adapted model (its output is still exactly the model's).
    Memory up to the device's recommended working set is wired first (Apple GPUs).
    """
    if path_or_hf_id is None:
        path_or_hf_id = str(demo_model_path())
    model_dir = resolve_model_path(str(path_or_hf_id), revision)  # also the demo by its name
    check_model_folder(model_dir)
    if pipeline is not None and adapter_path is not None:
        raise MTPLoadError("adapters are not supported across ranks: fuse them into the model first "
                           "(mlx_lm.fuse) and serve the fused folder")
    wired = loading.wire_recommended_memory()
    model, tokenizer = _load_backbone(model_dir, pipeline, lazy, chat_template, adapter_path, trust_remote_code)
    if use_default_chat_template:
        _use_default_chat_template(tokenizer, model_dir)
    _warn_if_beyond_wired(model, wired)
    if mtp:
        # attach_mtp itself records a missing head as disabled when it is not required.
        mtp_model = attach_mtp(model, model_dir, hidden_state=hidden_state, required=not mtp_fallback,
                               model_name=str(path_or_hf_id), draft_vocab=draft_vocab,
                               draft_vocab_file=draft_vocab_file)
        if not mtp_model.active:
            log.warning("MTP disabled: %s", mtp_model.disabled_reason)
    else:
        mtp_model = MTPModel(model, text_parts(model), None, None, {}, hidden_state,
                             disabled_reason="MTP not requested")
    if draft_vocab and not mtp_model.active:
        log.warning("draft vocabulary of %d tokens ignored: MTP is off", draft_vocab)
    mtp_model.model_dir = Path(model_dir)
    return mtp_model, tokenizer


def _load_backbone(model_dir: Path, pipeline, lazy: bool, chat_template: Optional[str], adapter_path,
                   trust_remote_code: bool = False):
    """(model, tokenizer) as mlx-lm loads them; what mlx-lm fails on (a config it cannot
    read, weights cut short, a model type it does not know) is a one-line ModelLoadError."""
    # The tokenizer's settings, as mlx-lm's server gives them (transformers' from_pretrained).
    tokenizer_config = {"chat_template": chat_template} if chat_template is not None else {}
    if trust_remote_code:
        tokenizer_config["trust_remote_code"] = True
    tokenizer_config = tokenizer_config or None
    try:
        if pipeline is not None:
            return loading.load_pipelined(model_dir, *pipeline, tokenizer_config=tokenizer_config)
        return loading.load(model_dir, lazy=lazy, tokenizer_config=tokenizer_config, adapter_path=adapter_path)
    except loading.AdapterError as e:
        raise MTPLoadError(str(e)) from e
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # RuntimeError: MLX's safetensors reader
        raise ModelLoadError(f"cannot load the model in {model_dir}: {e}") from e


def _use_default_chat_template(tokenizer, model_dir: Path) -> None:
    """As mlx-lm's --use-default-chat-template: a tokenizer without a chat template takes
    its default_chat_template; one without either cannot serve chats, which is said now."""
    if tokenizer.chat_template is not None:  # its own, or --chat-template's: that one wins
        return
    default = getattr(tokenizer, "default_chat_template", None)
    if default is None:
        raise ModelLoadError(f"the tokenizer in {model_dir} has no chat template and no default_chat_template "
                             "for --use-default-chat-template (transformers no longer gives tokenizers one): give "
                             "a template with serve's --chat-template, or leave the option out")
    tokenizer.chat_template = default
    tokenizer.has_chat_template = True  # mlx-lm's wrapper reads it (it was set before the template was)
    log.info("chat template: the tokenizer's default_chat_template (--use-default-chat-template)")


def _warn_if_beyond_wired(model: nn.Module, wired: Optional[int]) -> None:
    """mlx-lm's warning: weights near the recommended working set leave the caches little
    room, and decoding slows down as memory is swapped."""
    if not wired:
        return
    weights = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    if weights > 0.9 * wired:
        log.warning("the model's weights take %d MiB, close to the device's recommended working set of "
                    "%d MiB: decoding may be slow (see mlx-lm's notes on large models)",
                    weights >> 20, wired >> 20)


def inspect_model(path_or_hf_id: str) -> dict:
    """What `mlxmtp inspect` prints; reads configs and safetensors headers only."""
    model_dir = resolve_model_path(path_or_hf_id)
    check_model_folder(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {e}") from e
    family = family_of(config)
    tcfg = text_config(config)
    quant = config.get("quantization")
    source = locate_head(model_dir)
    mtp: dict = {"present": source is not None}
    if source is None:
        mtp.update(layers=0, location=None, expert_layout=None, hidden_state=None,
                   config_layers=tcfg.get("mtp_num_hidden_layers", tcfg.get("num_nextn_predict_layers")))
    elif source.location == "mtp_folder":
        c = source.config
        mtp.update(layers=c["num_layers"], location=str(source.path), expert_layout=c["expert_layout"],
                   num_experts=c["num_experts"], hidden_state=c.get("hidden_state", "post_norm"),
                   quantization=c.get("quantization") and {k: c["quantization"][k] for k in ("bits", "group_size")
                                                           if k in c["quantization"]},
                   source=c.get("source"))
    else:
        names = list(source.tensors)
        mtp.update(layers=hf_head.num_head_layers(names), location=str(source.path) + " (mtp.* tensors)",
                   expert_layout=hf_head.expert_layout(names), num_experts=hf_head.num_experts(names)
                   or _fused_experts(source), hidden_state="post_norm",
                   shards=sorted(set(source.tensors.values())))
    return {
        "path": str(model_dir),
        "family": family,
        "quantization": None if quant is None else {k: quant[k] for k in ("bits", "group_size", "mode") if k in quant},
        "dtype": tcfg.get("torch_dtype") or config.get("torch_dtype") or tcfg.get("dtype") or config.get("dtype"),
        "hidden_size": tcfg.get("hidden_size"),
        "num_hidden_layers": tcfg.get("num_hidden_layers"),
        "vocab_size": tcfg.get("vocab_size"),
        "num_experts": tcfg.get("num_experts", 0),
        "mtp": mtp,
    }


def _fused_experts(source: HeadSource) -> int:
    for name, shard in source.tensors.items():
        if name.endswith("experts.gate_up_proj"):
            header, _ = tensor_files.read_header(source.path / shard)
            return header[name]["shape"][0]
    return 0
