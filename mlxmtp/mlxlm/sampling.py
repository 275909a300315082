"""mlx-lm's sampling pieces (filters, logits processors) and its own generation loop, the
baseline `mlxmtp bench` compares against."""

from __future__ import annotations

from typing import Iterator, List

from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

__all__ = ["apply_min_p", "apply_top_k", "apply_top_p", "make_logits_processors", "make_sampler",
           "reference_tokens"]


def reference_tokens(model, tokenizer, prompt: List[int], max_tokens: int, temp: float) -> Iterator[int]:
    """mlx-lm's `stream_generate` at temperature `temp`: yields each token id it makes."""
    # mlx-lm's generation module on use: only the benchmarks run it.
    import mlx_lm

    for resp in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                       sampler=make_sampler(temp=temp)):
        yield resp.token
