"""The MTP proposer: feeds the head its pending inputs and chains k drafts.

Each row carries "pending" head inputs: pairs (main-model hidden at position i,
token at i+1) that the head has not consumed yet. After a verify that kept m drafts
they are the verify's own hidden states paired with the emitted tokens, so the head's
cache rows are always rebuilt from the main model's states (the exact scheme vLLM
uses), never from its own chained guesses. The chained rows written while drafting
are dropped after every cycle.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..models.family import TextParts
from ..models.mtp_head import MTPHead


def head_pass(head: MTPHead, parts: TextParts, head_cache: list, pend_h: Sequence[mx.array],
              pend_t: Sequence[List[int]], counts: Sequence[int]) -> mx.array:
    """Consume the first counts[b] pending pairs of every row; returns h' [B, P, H].

    Rows are right-padded to P = max(counts); the padding lands after each row's real
    entries (the causal mask hides it) and is trimmed from the head cache right after.
    """
    P = max(counts)
    H = parts.args.hidden_size
    toks, hids = [], []
    for h, t, n in zip(pend_h, pend_t, counts):
        toks.append(list(t[:n]) + [0] * (P - n))
        rows = h[:n] if n else mx.zeros((0, H), dtype=h.dtype)
        if n < P:
            rows = mx.concatenate([rows, mx.zeros((P - n, H), dtype=rows.dtype)])
        hids.append(rows)
    emb = parts.embed_tokens(mx.array(toks))
    out = head(emb, mx.stack(hids), head_cache)
    for c in head_cache:
        c.trim_rows([P - n for n in counts])
    return out


def draft(head: MTPHead, parts: TextParts, head_cache: list, pend_h: Sequence[mx.array],
          pend_t: Sequence[List[int]], k: int, pick) -> Tuple[mx.array, List[Optional[mx.array]]]:
    """Chain k drafts per row from all pending pairs.

    `pick(step, logits [B, V], drafts_so_far [B, step]) -> (tokens [B], q logprobs per row)`
    decides each draft (argmax, or a sample from the request's processed distribution).
    Returns drafts [B, k] and per row the q log-probabilities [k, V] (None when greedy).
    """
    counts = [len(t) for t in pend_t]
    g = head_pass(head, parts, head_cache, pend_h, pend_t, counts)
    B = g.shape[0]
    g = g[mx.arange(B), mx.array(counts) - 1][:, None, :]  # each row's last real position
    drafts: List[mx.array] = []
    qs: List[List[mx.array]] = [[] for _ in range(B)]
    for step in range(k):
        if step:
            g = head(parts.embed_tokens(drafts[-1][:, None]), g, head_cache)
        logits = parts.lm_head(g)[:, 0, :]
        so_far = mx.stack(drafts, axis=1) if drafts else mx.zeros((B, 0), dtype=mx.int32)
        tok, q = pick(step, logits, so_far)
        drafts.append(tok.astype(mx.int32))
        for b in range(B):
            if q[b] is not None:
                qs[b].append(q[b])
    q_rows = [mx.stack(q) if q else None for q in qs]
    return mx.stack(drafts, axis=1), q_rows
