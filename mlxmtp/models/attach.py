"""Attaching the MTP head to a loaded mlx-lm model: find it, build it, check it, and give
the `MTPModel` (or, where MTP may fall back, one with MTP off and the reason)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import mlx.nn as nn

from ..checkpoint import mtp_folder
from ..checkpoint.norm_convention import norm_reference
from ..checkpoint.token_list import DraftVocabError
from ..mlxlm.family import TextParts, text_parts
from .draft_vocab import DraftVocab, draft_token_ids
from .errors import MissingMTPHeadError, MTPLoadError
from .head_build import build_head, check_norm_convention
from .head_source import read_head
from .mtp_model import MTPModel

log = logging.getLogger("mlxmtp")

# The commands add how to run without the head where it is required (serve: drop --enable-mtp;
# generate: --disable-mtp), as the options differ; a head that is off already needs neither.
REPAIR_HINT = "Repair it with: mlxmtp add-mtp-weights --model {model} --source <BF16 HF checkpoint or repo id>."
HIDDEN_STATES = ("post_norm", "pre_norm")


def attach_mtp(model: nn.Module, model_dir: Path, *, hidden_state: str = "post_norm",
               required: bool = True, model_name: str = "", draft_vocab: int = 0,
               draft_vocab_file: Optional[Path] = None) -> MTPModel:
    """`model` with its head, as an MTPModel (a missing head raises MissingMTPHeadError when
    `required`, else gives an MTPModel with MTP off and the reason)."""
    if hidden_state not in HIDDEN_STATES:
        raise ValueError(f"hidden_state must be one of {HIDDEN_STATES}")
    parts = text_parts(model)
    try:  # a head that cannot be read or built: as a missing one where MTP may fall back
        reference = norm_reference(parts.backbone)  # the model's own norms: the head's are judged by them
        found = read_head(model_dir, reference)
        if found is not None:
            source, (weights, info, quantization) = found
            head = build_head(parts, weights, info, quantization)
            check_norm_convention(reference, head)
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
