"""Anthropic's `thinking.budget_tokens` as an upper bound on the reasoning tokens.

A logits processor on the request: once the reasoning has N tokens and is still open,
the next token is forced to be the think-close marker (`</think>`), and the model goes
on with its answer. Until then it returns the logits untouched, so the output is
exactly what the model would write without a budget unless the budget is hit:

* while fewer than N tokens were generated, it does nothing at all (no graph);
* after that, the check is built lazily on the context (`mx.where(hit, forced, logits)`,
  no host sync): where the budget is not hit, the same logits come back bit for bit.

The engine applies a request's processors to every distribution it samples from or
verifies against (the MTP head's drafts and the main model's verify rows alike), each
with its own context, so speculative decoding stays exact with the budget in force.

"Reasoning" is what follows the think-open marker: from the first generated token when
the prompt left `<think>` open, else from the first `<think>` the model writes (Qwen3
hybrid templates let the model open it). The marker must be one token in the vocabulary
(it is in every Qwen3 tokenizer); otherwise no budget is enforced.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import mlx.core as mx

from .reasoning import THINK_END, THINK_START


def think_token_ids(tok) -> Optional[Tuple[int, int]]:
    """(id of `<think>`, id of `</think>`), or None if either is not a single token."""
    ids = [tok.encode(t, add_special_tokens=False) for t in (THINK_START, THINK_END)]
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


def budget_processor(prompt_len: int, budget: int, start_id: int, end_id: int,
                     starts_inside: bool) -> Callable:
    """Processor (context [prompt + generated], logits [1, V]) -> logits, forcing `end_id`
    when `budget` reasoning tokens were generated and the block is still open."""

    def proc(ctx: mx.array, logits: mx.array) -> mx.array:
        n = int(ctx.shape[0]) - prompt_len  # tokens generated before the one being chosen
        if n < budget:
            return logits  # fewer tokens than the budget: cannot be hit
        gen = ctx[prompt_len:]
        if starts_inside:
            hit = mx.logical_not(mx.any(gen == end_id))
        else:
            pos = mx.arange(n)
            opened = mx.min(mx.where(gen == start_id, pos, n))  # first <think>, n if none
            closed = mx.any((gen == end_id) & (pos > opened))
            hit = (opened < n) & mx.logical_not(closed) & (n - 1 - opened >= budget)
        forced = mx.where(mx.arange(logits.shape[-1]) == end_id, 0.0, -1e9).astype(logits.dtype)
        return mx.where(hit, forced, logits)

    # Untouched logits below this context length: the engine leaves it out until a cycle
    # could reach it (RowSampler.live), so the row takes the engine's fast paths till then.
    proc.idle_below = prompt_len + budget
    # How another rank of a distributed server rebuilds it (distributed/wire.py).
    proc.recipe = ("mlxmtp.server.thinking_budget:budget_processor",
                   [prompt_len, budget, start_id, end_id, starts_inside])
    return proc


def add_budget(req, tok, budget: Optional[int], starts_inside: bool) -> bool:
    """Give the engine request a thinking budget; False when none applies (no budget, one
    the output cannot reach, or a tokenizer without single-token think markers)."""
    if budget is None or budget >= req.max_tokens:
        return False
    ids = think_token_ids(tok)
    if ids is None:
        return False
    req.params.logits_processors.append(budget_processor(len(req.prompt), budget, *ids, starts_inside))
    return True
