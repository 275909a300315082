"""The token embedding and output projection as the MTP head's draft steps use them.

On MLX's CPU backend a half-precision matrix times a float32 activation (the head
computes in float32 there, see head_build.build_head) casts the whole matrix on every call:
for the tied 2048 x 192 table of the demo model the draft step's lm_head took ~1.5 ms of
a ~3.5 ms step, against ~0.7 ms with a float32 copy. So on the CPU, for unquantized
tables up to `MAX_COPY_BYTES`, the drafter keeps its own float32 copy. Drafts are always
verified by the main model, so this changes acceptance at most, never output; the main
model's own logits keep using the model's weights (bit-identical to mlx-lm).

A trimmed draft vocabulary (checkpoint/token_list.py) restricts the draft's output
projection to the listed rows, gathered once at load. `lm_head` still returns logits
over the full vocabulary, -inf outside the list: argmax, the request's processors and
filters and the rejection sampler need no change, and q is a proper distribution over
the list, 0 elsewhere (a draft is always sampled from q, so q(draft) > 0 and the
residual max(p - q, 0) is simply p outside the list).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..checkpoint import token_list
from ..mlxlm.family import TextParts

log = logging.getLogger("mlxmtp")

MAX_COPY_BYTES = 64 * 2**20
# Trimming pays off for big output tables only (Qwen3.5: 248K rows); smaller ones stay whole.
MIN_TRIM_VOCAB = 65536
_HALF = (mx.float16, mx.bfloat16)


class DraftVocab:
    """Duck-types the parts of TextParts the proposer uses: args, embed_tokens, lm_head.

    token_ids: restrict the draft's lm_head to these rows (a trimmed draft vocabulary)."""

    def __init__(self, parts: TextParts, compute_dtype: Optional[Any] = None,
                 token_ids: Optional[Sequence[int]] = None):
        self.parts = parts
        self.args = parts.args
        emb = parts.embed_tokens
        out = emb if parts.tied else parts.text_model.lm_head
        self.full_size = out.weight.shape[0]
        self.token_ids = self._rows = self._quant = None
        if token_ids is not None:
            ids = token_list.check_token_ids(list(token_ids), self.full_size)
            self.token_ids = mx.array(ids, dtype=mx.int32)
            self._rows, self._quant = _select_rows(out, self.token_ids)
        self._embed = self._out = None
        if self._wants_copy(compute_dtype, emb, out):
            self._embed = emb.weight.astype(mx.float32)
            if self._rows is not None:
                self._rows = {k: v.astype(mx.float32) for k, v in self._rows.items()}
            else:
                self._out = self._embed if out is emb else out.weight.astype(mx.float32)
        mx.eval(self._embed, self._out, self._rows)

    def _wants_copy(self, compute_dtype, emb: nn.Module, out: nn.Module) -> bool:
        """float32 copies: on the CPU, float32 head, unquantized half tables, small enough."""
        if compute_dtype is None or compute_dtype != mx.float32 or mx.default_device() != mx.cpu:
            return False
        if any(hasattr(m, "scales") or m.weight.dtype not in _HALF for m in (emb, out)):
            return False
        if self._rows is not None:
            out_size = self._rows["weight"].size
        else:
            out_size = 0 if out is emb else out.weight.size
        return (emb.weight.size + out_size) * 4 <= MAX_COPY_BYTES

    @property
    def copied(self) -> bool:
        return self._embed is not None

    @property
    def trimmed(self) -> bool:
        return self.token_ids is not None

    def embed_tokens(self, ids: mx.array) -> mx.array:
        return self.parts.embed_tokens(ids) if self._embed is None else self._embed[ids]

    def lm_head(self, h: mx.array) -> mx.array:
        if self._rows is None:
            return self.parts.lm_head(h) if self._out is None else h @ self._out.T
        small = _project(h, self._rows, self._quant)
        full = mx.full((*small.shape[:-1], self.full_size), -mx.inf, dtype=small.dtype)
        # A scatter: ~0.1 ms for 32K of 248K columns on the CPU (a gather through an
        # id -> column map took ~4 ms).
        return mx.put_along_axis(full, mx.broadcast_to(self.token_ids, small.shape), small, axis=-1)


def _select_rows(out: nn.Module, ids: mx.array):
    """The listed rows of an output table: (arrays, quantization or None).

    Quantized tables (QuantizedLinear, or QuantizedEmbedding used as_linear when tied)
    keep their packed rows: weight, scales and biases are gathered row by row (each
    output row owns its own row of each), so the trimmed projection is the model's own
    quantized_matmul over fewer rows, at a quarter of the memory of dequantized rows."""
    if not isinstance(out, (nn.Linear, nn.Embedding, nn.QuantizedLinear, nn.QuantizedEmbedding)):
        raise token_list.DraftVocabError(f"cannot trim an output table of type {type(out).__name__}")
    rows = {k: out[k][ids] for k in ("weight", "scales", "biases", "bias") if out.get(k) is not None}
    quant = None
    if "scales" in rows:
        quant = dict(group_size=out.group_size, bits=out.bits, mode=getattr(out, "mode", "affine"))
    return rows, quant


def _project(h: mx.array, rows: Dict[str, mx.array], quant: Optional[dict]) -> mx.array:
    if quant is None:
        y = h @ rows["weight"].T
    else:
        y = mx.quantized_matmul(h, rows["weight"], scales=rows["scales"], biases=rows.get("biases"),
                                transpose=True, **quant)
    return y + rows["bias"] if "bias" in rows else y


def draft_token_ids(parts: TextParts, model_dir: Path, size: int, path: Optional[Path] = None,
                    min_vocab: Optional[int] = None) -> Optional[list]:
    """The first `size` ids of the model's token list, or None (logged) where the vocabulary
    is too small to be worth trimming. A missing or unusable list raises DraftVocabError."""
    out = parts.embed_tokens if parts.tied else parts.text_model.lm_head
    rows = out.weight.shape[0]
    min_vocab = MIN_TRIM_VOCAB if min_vocab is None else min_vocab
    if rows <= min_vocab:
        log.info("draft vocabulary not trimmed: the vocabulary has %d tokens, trimming is for more than %d",
                 rows, min_vocab)
        return None
    path = Path(path) if path else token_list.default_path(model_dir)
    if path is None or not path.exists():
        where = path or f"{model_dir}/{token_list.FILE} (the model has no mtp/ folder: give --draft-vocab-file)"
        raise token_list.DraftVocabError(
            f"--draft-vocab {size}: no token list at {where}. Make one with: mlxmtp draft-vocab "
            f"--model {model_dir} --corpus FILE... --size {size}")
    return token_list.read_token_list(path, size, rows)
