"""A tokenizer's text, exactly: the streaming detokenizer and a token's own bytes.

mlx-lm is imported on use (see loading.py).
"""

from __future__ import annotations


def exact_text(tokenizer):
    """The tokenizer, its streaming detokenizer made to keep a text's first space.

    mlx-lm's BPE detokenizer drops the first character of its text when that is a space
    (meant for SentencePiece's added prefix space). Byte-level BPE (every Qwen model) adds
    none, so the dropped space was the model's: `x =` completed as `0` instead of ` 0`, and
    an indented first line of code lost a column. mlx-lm's class is reused, without the trim.
    """
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer  # mlx-lm on use (see loading.py)

    class ExactBPEDetokenizer(BPEStreamingDetokenizer):
        def _maybe_trim_space(self, current_text):
            return current_text

    detok = getattr(tokenizer, "_detokenizer", None)
    if type(detok) is BPEStreamingDetokenizer:  # copy its state: the token map took a vocabulary pass
        exact = ExactBPEDetokenizer.__new__(ExactBPEDetokenizer)
        exact.__dict__.update(detok.__dict__)
        tokenizer._detokenizer = exact
    return tokenizer


def token_bytes(tokenizer, token: int) -> bytes:
    """A token's own bytes. A byte-level BPE token can be part of a UTF-8 character (the
    first byte of "é"), which decoding it alone turns into U+FFFD; clients join these bytes
    (OpenAI's logprobs `bytes`) to rebuild such text."""
    from mlx_lm.tokenizer_utils import _byte_decoder  # mlx-lm on use (see loading.py)

    tokenmap = getattr(getattr(tokenizer, "_detokenizer", None), "tokenmap", None)
    if tokenmap is not None and 0 <= token < len(tokenmap):
        decoder = _byte_decoder()
        piece = tokenmap[token]
        if all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
    return tokenizer.decode([token]).encode("utf-8")
