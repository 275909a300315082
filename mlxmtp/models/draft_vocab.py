"""The token embedding and output projection as the MTP head's draft steps use them.

On MLX's CPU backend a half-precision matrix times a float32 activation (the head
computes in float32 there, see load.build_head) casts the whole matrix on every call:
for the tied 2048 x 192 table of the demo model the draft step's lm_head took ~1.5 ms of
a ~3.5 ms step, against ~0.7 ms with a float32 copy. So on the CPU, for unquantized
tables up to `MAX_COPY_BYTES`, the drafter keeps its own float32 copy. Drafts are always
verified by the main model, so this changes acceptance at most, never output; the main
model's own logits keep using the model's weights (bit-identical to mlx-lm).
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx

from .family import TextParts

MAX_COPY_BYTES = 64 * 2**20


class DraftVocab:
    """Duck-types the parts of TextParts the proposer uses: args, embed_tokens, lm_head."""

    def __init__(self, parts: TextParts, compute_dtype: Optional[Any] = None):
        self.parts = parts
        self.args = parts.args
        self._embed = self._out = None
        emb = parts.embed_tokens
        out = None if parts.tied else parts.text_model.lm_head
        tables = [m for m in (emb, out) if m is not None]
        if (compute_dtype is not None and compute_dtype == mx.float32 and mx.default_device() == mx.cpu
                and all(not hasattr(m, "scales") and m.weight.dtype in (mx.float16, mx.bfloat16) for m in tables)
                and sum(m.weight.size * 4 for m in tables) <= MAX_COPY_BYTES):
            self._embed = emb.weight.astype(mx.float32)
            self._out = self._embed if out is None else out.weight.astype(mx.float32)
            mx.eval(self._embed, self._out)

    @property
    def copied(self) -> bool:
        return self._embed is not None

    def embed_tokens(self, ids: mx.array) -> mx.array:
        return self.parts.embed_tokens(ids) if self._embed is None else self._embed[ids]

    def lm_head(self, h: mx.array) -> mx.array:
        return self.parts.lm_head(h) if self._out is None else h @ self._out.T
