"""The MTP head's drafting (wrapped as a Proposer by mtp.py): feeds the head its pending
inputs and chains k drafts.

Each row carries "pending" head inputs: pairs (main-model hidden at position i,
token at i+1) that the head has not consumed yet. After a verify that kept m drafts
they are the verify's own hidden states paired with the emitted tokens, so the head's
cache rows are always rebuilt from the main model's states (the exact scheme vLLM
uses), never from its own chained guesses. The chained rows written while drafting
are dropped after every cycle.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from ...mlxlm.family import TextParts
from ...mlxlm.model_cache import ModelCache
from ...models.draft_vocab import DraftVocab
from ...models.mtp_head import MTPHead

# A row's pending hidden states are kept as segments (array, row, n): the first n
# positions of array[row] ([B, T, H] from a batched forward) or of array itself when
# row is None ([T, H]). Appending one costs no MLX op; slicing happens only when the
# head consumes them, and when every row's inputs are the previous forward's own rows
# the head takes that batch array as it is.
Segment = Tuple[mx.array, Optional[int], int]

# What the drafter needs of the model: args, embed_tokens(ids), lm_head(h) (TextParts, or
# models.draft_vocab.DraftVocab with float32 copies on the CPU).
Vocab = Union[TextParts, DraftVocab]


def pending_count(segs: Sequence[Segment]) -> int:
    return sum(n for _, _, n in segs)


def pending_array(segs: Sequence[Segment]) -> Optional[mx.array]:
    parts = [a[b, :n] if b is not None else a[:n] for a, b, n in segs]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def drop_pending(segs: Sequence[Segment], n: int) -> List[Segment]:
    """The pending inputs without their first n (never shown to the head)."""
    h = pending_array(segs)
    left = pending_count(segs) - n
    return [(h[n:], None, left)] if left > 0 else []


def _batch_view(pend: Sequence[Sequence[Segment]], P: int) -> Optional[mx.array]:
    """The [B, P, H] head input, free, when every row's pending is row b of one array."""
    if not pend or any(len(segs) != 1 for segs in pend):
        return None
    arr = pend[0][0][0]
    B = len(pend)
    if arr.ndim != 3 or arr.shape[0] != B:
        return None
    if any(segs[0][0] is not arr or segs[0][1] != b for b, segs in enumerate(pend)):
        return None
    return _pad_positions(arr[:, :P], P, axis=1)


def _pad_positions(x: mx.array, P: int, axis: int) -> mx.array:
    """x with zeros appended along `axis` up to P positions (head_pass's padding)."""
    n = x.shape[axis]
    if n >= P:
        return x
    shape = list(x.shape)
    shape[axis] = P - n
    return mx.concatenate([x, mx.zeros(shape, x.dtype)], axis=axis)


def _head_forward(head: MTPHead, vocab: Vocab, head_cache: ModelCache, tokens: mx.array, hidden: mx.array) -> mx.array:
    """The head over (embedding of tokens [B, P], hidden [B, P, H]) -> h' [B, P, H]."""
    emb = vocab.embed_tokens(tokens)
    return head(emb, hidden.astype(emb.dtype) if hidden.dtype != emb.dtype else hidden, head_cache)


def head_pass(head: MTPHead, vocab: Vocab, head_cache: ModelCache, pend: Sequence[Sequence[Segment]],
              pend_t: Sequence[List[int]], counts: Sequence[int],
              width: int = 0) -> Tuple[mx.array, List[List[Segment]]]:
    """Consume the first counts[b] pending pairs of every row.

    Returns (h' [B, P, H], what is left pending per row). Rows are right-padded to
    P = max(counts), or to the head cache's shape bucket for that many tokens in its
    shape-stable mode (`width` when they fit: the engine's deepest verify, so every pass
    of a drafting cycle has one shape; a catch-up after a plain-decoding stretch of any
    length takes one of a few larger ones); the padding lands
    after each row's real entries (the causal mask hides it) and is trimmed from the head
    cache right after.
    """
    P = head_cache[0].query_bucket(max(counts), width) if head_cache else max(counts)
    H = vocab.args.hidden_size
    toks = [list(t[:n]) + [0] * (P - n) for t, n in zip(pend_t, counts)]
    hid = _batch_view(pend, P)
    rest: List[List[Segment]] = []
    if hid is None:
        rows = []
        for segs, n in zip(pend, counts):
            h = pending_array(segs)
            if h is None:
                h = mx.zeros((0, H), dtype=mx.float32)
            left = pending_count(segs) - n
            rest.append([(h[n:], None, left)] if left > 0 else [])
            rows.append(_pad_positions(h[:n], P, axis=0))
        hid = mx.stack(rows)
    else:
        rest = [[] for _ in pend]
        for b, (segs, n) in enumerate(zip(pend, counts)):
            arr, _, total = segs[0]
            if total > n:
                rest[b] = [(arr[b, n:total], None, total - n)]
    out = _head_forward(head, vocab, head_cache, mx.array(toks), hid)
    head_cache.trim_rows([P - n for n in counts])
    return out, rest


def draft(head: MTPHead, vocab: Vocab, head_cache: ModelCache, pend: Sequence[Sequence[Segment]],
          pend_t: Sequence[List[int]], k: int, pick, width: int = 0) -> Tuple[mx.array, Optional[mx.array]]:
    """Chain k drafts per row from all pending pairs.

    `pick(step, logits [B, V], drafts_so_far [B, step]) -> (tokens [B], q logprobs [B, V] or
    None)` decides each draft (argmax, or a sample from the request's processed distribution).
    Returns drafts [B, k] and the q log-probabilities [B, k, V] (None when every row is greedy).
    `width`: the head pass's query width in shape-stable mode (see head_pass).
    """
    counts = [len(t) for t in pend_t]
    g, _ = head_pass(head, vocab, head_cache, pend, pend_t, counts, width)
    g = g[mx.arange(g.shape[0]), mx.array(counts) - 1][:, None, :]  # each row's last real position
    return chain(head, vocab, head_cache, g, k, pick)


def draft_unread(head: MTPHead, vocab: Vocab, head_cache: ModelCache, hidden: mx.array, tokens: mx.array,
                 kept: mx.array, k: int, pick, width: int) -> Tuple[mx.array, Optional[mx.array]]:
    """`draft` right after a cycle that was not read yet: its pending inputs are that cycle's
    hidden states [B, T, H] paired with its tokens [B, T], of which row b's first kept[b] + 1
    are real (kept [B] on the device). The head takes all T (padded to its shape bucket) and
    defers the trim of what is not real (a shape-stable head cache, see RaggedKVCache)."""
    B, T = tokens.shape
    P = head_cache[0].query_bucket(T, width)
    g = _head_forward(head, vocab, head_cache, _pad_positions(tokens, P, axis=1), _pad_positions(hidden, P, axis=1))
    head_cache.defer_trim(P - 1 - kept)
    g = g[mx.arange(B), kept][:, None, :]
    return chain(head, vocab, head_cache, g, k, pick)


def chain(head: MTPHead, vocab: Vocab, head_cache: ModelCache, g: mx.array, k: int,
          pick) -> Tuple[mx.array, Optional[mx.array]]:
    """k drafts per row, chained from the head states g [B, 1, H] (see `draft`)."""
    B = g.shape[0]
    drafts: List[mx.array] = []
    qs: List[mx.array] = []
    for step in range(k):
        if step:
            g = head(vocab.embed_tokens(drafts[-1][:, None]), g, head_cache)
        logits = vocab.lm_head(g)[:, 0, :]
        so_far = mx.stack(drafts, axis=1) if drafts else mx.zeros((B, 0), dtype=mx.int32)
        tok, q = pick(step, logits, so_far)
        drafts.append(tok.astype(mx.int32))
        if q is not None:
            qs.append(q)
    return mx.stack(drafts, axis=1), mx.stack(qs, axis=1) if qs else None
