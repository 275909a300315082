"""A short measurement of what decode cycles of each depth cost, before the depth policy
first needs them (the server: for one row, at start-up; later batch sizes learn theirs
from their own cycles, see DepthPolicy.needs_costs).

Without it the policy learns its costs from live cycles alone: blocks of plain decoding
and k = 1 at the start, then probes of every other depth, each switch paid by real
requests. Here, on scratch caches (the engine's own state is never touched), the engine's
own calls are timed at a batch of `batch_size` rows:
- plain decoding as the engine runs it, pipelined (each forward queued before the
  previous token is read);
- for k = 1..max_depth, drafting cycles as the engine runs them: the head chaining k
  drafts, then a verify forward of k+1 tokens with the Gated DeltaNet capture on, and the
  accept step's argmax; synchronous, or pipelined (each queued before the previous one is
  done) where the engine pipelines drafting cycles (shape-stable caches).
The policy takes these as prior samples of its cost ratios; the cycles it times itself
replace them as they come (see DepthPolicy.seed_costs). On a GPU this takes a fraction
of a second and compiles the kernels of these shapes on the way.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict

import mlx.core as mx

from ..mlxlm import adapter, gdn_capture
from .pieces import ModelPieces
from .proposer import chain

CONTEXT = 64  # scratch tokens in the caches before timing (position barely matters)
REPS = 5  # timed rounds over every depth, after one untimed round


def measure_cycle_costs(pieces: ModelPieces, batch_size: int, max_depth: int,
                        shape_stable: bool, pipelined: bool = False) -> Dict[int, float]:
    """Seconds per decode cycle of depth k = 0..max_depth at `batch_size` rows;
    `pipelined`: drafting cycles are pipelined (see the module docstring)."""
    cache = adapter.make_cache(pieces.parts, batch_size)
    head_cache = adapter.make_head_cache(pieces.head, batch_size)
    _, hidden = adapter.forward(pieces.parts, mx.zeros((batch_size, CONTEXT), mx.int32), cache,
                                pieces.hidden_state)
    pieces.head(pieces.vocab.embed_tokens(mx.zeros((batch_size, CONTEXT), mx.int32)), hidden, head_cache)
    mx.eval(*adapter.cache_arrays(cache), *adapter.cache_arrays(head_cache))
    if shape_stable:
        adapter.fix_shapes(cache, 2)
        adapter.fix_shapes(head_cache, 1)
    g = hidden[:, -1:]
    n = 3 if pipelined else 1
    runs = {0: lambda: _plain_steps(pieces, cache, batch_size, 4) / 4}
    for k in range(1, max_depth + 1):
        runs[k] = lambda depth=k: _drafting_cycles(pieces, cache, head_cache, g, depth, n) / n
    return _interleaved(runs)


def _interleaved(runs: Dict[int, Callable[[], float]]) -> Dict[int, float]:
    """Seconds per cycle of each depth: every depth once per round (after an untimed round
    that compiles and waits out work already queued), each round's times taken relative to
    its own plain cycles, the median of those ratios times the median plain cycle. Ratios
    of neighbours, as the policy keeps them: a machine whose speed drifts between seconds
    shifts a round as a whole."""
    for run in runs.values():
        run()
    rounds = [{k: run() for k, run in runs.items()} for _ in range(REPS)]
    plain = statistics.median(r[0] for r in rounds)
    return {k: plain * statistics.median(r[k] / r[0] for r in rounds) for k in runs}


def _plain_steps(pieces: ModelPieces, cache: list, batch_size: int, n: int) -> float:
    """n plain decoding steps, pipelined as the engine runs them -> seconds."""
    t = time.perf_counter()
    y = mx.zeros((batch_size, 1), mx.int32)
    for _ in range(n):
        logits, _ = adapter.forward(pieces.parts, y, cache, pieces.hidden_state)
        y = mx.argmax(logits[:, -1:], axis=-1).astype(mx.int32)
        mx.async_eval(y)
    mx.eval(y, *adapter.cache_arrays(cache))
    _trim(cache, n)
    return time.perf_counter() - t


def _drafting_cycles(pieces: ModelPieces, cache: list, head_cache: list, g: mx.array, k: int, n: int) -> float:
    """n cycles of depth k, each queued on the device while the host builds the next -> seconds."""
    t = time.perf_counter()
    for _ in range(n):
        out = _drafting_cycle(pieces, cache, head_cache, g, k)
        mx.async_eval(out)
    mx.eval(out)
    return time.perf_counter() - t


def _drafting_cycle(pieces: ModelPieces, cache: list, head_cache: list, g: mx.array, k: int) -> list:
    """One drafting cycle's graph (queued by the caller): the head's pass over the last
    verify's state, k chained drafts as the proposer makes them, the verify and its argmax."""
    B = g.shape[0]
    ys = mx.zeros((B, 1), mx.int32)
    g = pieces.head(pieces.vocab.embed_tokens(ys), g, head_cache)
    drafts, _ = chain(pieces.head, pieces.vocab, head_cache, g, k, _argmax_pick)
    mx.async_eval(drafts)
    inputs = mx.concatenate([ys, drafts], axis=1)
    with gdn_capture.record():
        logits, _ = adapter.forward(pieces.parts, inputs, cache, pieces.hidden_state)
    out = [mx.argmax(logits, axis=-1), *adapter.cache_arrays(cache)]
    _trim(cache, k + 1)
    _trim(head_cache, k)
    return out


def _argmax_pick(step: int, logits: mx.array, so_far: mx.array):
    return mx.argmax(logits, axis=-1), [None] * logits.shape[0]


def _trim(cache: list, n: int) -> None:
    """Attention caches back to where they were (the Gated DeltaNet state just moves on:
    its cost does not depend on its values)."""
    for c in adapter.attention_caches(cache):
        c.trim_rows([n] * len(c.lengths))
