"""Load an mlx-lm model with its MTP head: `load`, the entry point.

mlx-lm loads the main model (and drops `mtp.*` in every `sanitize`); `load` finds the
model's folder (model_folder.py, hub.py), has mlx-lm load it (backbone.py), then attaches
the head (attach.py: head_source.py finds its weights, in the HF checkpoint itself or in an
injected `mtp/` folder, and head_build.py builds an `MTPHead` from mlx-lm's own layer
classes). It returns an `MTPModel` (mtp_model.py) holding the untouched mlx-lm model, the
head and what the engine learns about them (the model's parameter tree and logits stay
exactly stock mlx-lm's).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from ..mlxlm import loading
from ..mlxlm.family import text_parts
from . import backbone
from .attach import attach_mtp
from .demo import demo_model_path
from .errors import MTPLoadError
from .model_folder import check_model_folder, resolve_model_path
from .mtp_model import MTPModel

log = logging.getLogger("mlxmtp")


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
    model, tokenizer = backbone.load_backbone(model_dir, pipeline, lazy, chat_template, adapter_path, trust_remote_code)
    if use_default_chat_template:
        backbone.use_default_chat_template(tokenizer, model_dir)
    backbone.warn_if_beyond_wired(model, wired)
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
