"""A short measurement of what decode cycles of each depth cost, before the depth policy
first needs them (the server: for one row, at start-up; later batch sizes learn theirs
from their own cycles, see DepthPolicy.needs_costs).

Without it the policy learns its costs from live cycles alone: blocks of plain decoding
and one drafting depth at the start, then probes of every other depth, each switch paid
by real requests. Here, on scratch caches (the engine's own state is never touched), the
engine's own calls are timed at a batch of `batch_size` rows, for greedy batches and for
batches of sampled rows (their draft and accept steps are the engine's sampled ones:
per-row distributions, random draws, rejection sampling; more work per cycle). The server
measures both at start-up, before any request; an engine whose first decode cycle finds no
costs (`mlxmtp generate`, `mlxmtp bench`) measures its batch's kind only, half the wait,
and a batch of the other kind learns its costs from its own cycles, as a batch size reached
later does:
- plain decoding as the engine runs it, pipelined (each forward queued before the
  previous token is read);
- for k = 1..max_depth, drafting cycles as the engine runs them: the head chaining k
  drafts, then a verify forward of k+1 tokens with the Gated DeltaNet capture on, and the
  accept step; synchronous, or pipelined (each queued before the previous one is done)
  where the engine pipelines drafting cycles (shape-stable caches).
The policy takes these as prior samples of its cost ratios; the cycles it times itself
replace them as they come (see DepthPolicy.seed_costs). On a GPU this takes a fraction
of a second and compiles the kernels of these shapes on the way.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, Hashable, List, Optional, Sequence

import mlx.core as mx

from ...mlxlm import adapter, gdn_capture
from ...mlxlm.model_cache import ModelCache
from ..pieces import ModelPieces
from ..proposers.mtp_head import chain
from ..sampling.accept import VerifyMetadata, accept, picker
from ..sampling.params import SamplingParams
from ..sampling.row import RowSampler
from .base import COST_KINDS, SAMPLED

CONTEXT = 64  # scratch tokens in the caches before timing (position barely matters)
REPS = 5  # timed rounds over every depth, after one untimed round
PLAIN_CYCLES = 4  # plain cycles timed together in one run (one alone is too short to time)


def drafting_cycles(pipelined: bool) -> int:
    """Drafting cycles timed together in one run: pipelined ones overlap their neighbours."""
    return 3 if pipelined else 1


def seed_policy(policy, pieces: ModelPieces, batch_size: int, shape_stable: bool, pipelined: bool,
                progress: Optional[Callable[[], None]] = None, kinds: Sequence[str] = COST_KINDS) -> None:
    """Measure cycle costs at `batch_size` rows for batches of `kinds` (policy.cost_kind) and
    seed the depth policy (policy.Policy.seed_costs) with them; `progress` as
    measure_cycle_costs takes it."""
    costs = measure_cycle_costs(pieces, batch_size, policy.max_depth, shape_stable, pipelined, kinds=kinds,
                                progress=progress)
    for kind, seconds in costs.items():
        policy.seed_costs(batch_size, seconds, kind)


def measure_cycle_costs(pieces: ModelPieces, batch_size: int, max_depth: int, shape_stable: bool,
                        pipelined: bool = False, kinds: Sequence[str] = COST_KINDS,
                        progress: Optional[Callable[[], None]] = None) -> Dict[str, Dict[int, float]]:
    """Seconds per decode cycle of depth k = 0..max_depth at `batch_size` rows, per batch
    kind (policy.cost_kind); `pipelined`: drafting cycles are pipelined (see the module
    docstring). `progress` is called after each timed run: a distributed run's watchdog
    counts its silence from there, since the whole calibration (hundreds of forwards, the
    first of each shape compiling) can outlast the time one step may take."""
    cache = adapter.make_cache(pieces.parts, batch_size)
    head_cache = adapter.make_head_cache(pieces.head, batch_size)
    _, hidden = adapter.forward(pieces.parts, mx.zeros((batch_size, CONTEXT), mx.int32), cache,
                                pieces.hidden_state)
    pieces.head(pieces.vocab.embed_tokens(mx.zeros((batch_size, CONTEXT), mx.int32)), hidden, head_cache)
    mx.eval(*cache.arrays(), *head_cache.arrays())
    if shape_stable:
        cache.fix_shapes(2)
        head_cache.fix_shapes(1)
    g = hidden[:, -1:]
    n = drafting_cycles(pipelined)
    runs = {}
    for kind in kinds:
        rows = _Rows(pieces, batch_size, kind)
        runs[kind, 0] = lambda rows=rows: _plain_steps(pieces, cache, rows, PLAIN_CYCLES) / PLAIN_CYCLES
        for k in range(1, max_depth + 1):
            runs[kind, k] = lambda depth=k, rows=rows: _drafting_cycles(pieces, cache, head_cache, g, rows, depth, n) / n
    seconds = _interleaved(runs, progress)
    return {kind: {k: seconds[kind, k] for k in range(max_depth + 1)} for kind in kinds}


class _Rows:
    """Scratch rows of one batch kind: their samplers (temperature 1 for sampled rows: the
    cost does not depend on the values), as the engine's draft and accept steps take them."""

    def __init__(self, pieces: ModelPieces, batch_size: int, kind: str):
        temperature = 1.0 if kind == SAMPLED else 0.0
        self.samplers = [RowSampler(SamplingParams(temperature=temperature, seed=b)) for b in range(batch_size)]
        self.contexts: List[List[int]] = [[0] for _ in range(batch_size)]
        self.ids = [-1] * batch_size
        self.pick = picker(self.samplers, self.contexts, self.ids)

    def accept(self, logits: mx.array, drafts: mx.array, q: Optional[mx.array], compiled: bool):
        """(kept, tokens) of the engine's accept step for these rows."""
        meta = VerifyMetadata(drafts, q, self.samplers, self.contexts, self.ids, None, compiled=compiled)
        kept, tokens, _, _ = accept(meta, logits)
        return kept, tokens


def _interleaved(runs: Dict[Hashable, Callable[[], float]],
                 progress: Optional[Callable[[], None]] = None) -> Dict[Hashable, float]:
    """Seconds per cycle of each run: every run once per round (after an untimed round
    that compiles and waits out work already queued), each round's times taken relative to
    its first run's (plain greedy decoding), the median of those ratios times that run's
    median. Ratios of neighbours, as the policy keeps them: a machine whose speed drifts
    between seconds shifts a round as a whole."""
    def timed(run):
        seconds = run()
        if progress is not None:
            progress()
        return seconds

    for run in runs.values():
        timed(run)
    rounds = [{key: timed(run) for key, run in runs.items()} for _ in range(REPS)]
    base = next(iter(runs))
    plain = statistics.median(r[base] for r in rounds)
    return {key: plain * statistics.median(r[key] / r[base] for r in rounds) for key in runs}


def _plain_steps(pieces: ModelPieces, cache: ModelCache, rows: _Rows, n: int) -> float:
    """n plain decoding steps, pipelined as the engine runs them -> seconds."""
    t = time.perf_counter()
    B = len(rows.samplers)
    y = mx.zeros((B, 1), mx.int32)
    for _ in range(n):
        logits, _ = adapter.forward(pieces.parts, y, cache, pieces.hidden_state)
        _, y = rows.accept(logits[:, -1:], mx.zeros((B, 0), mx.int32), None, pieces.compiled)
        mx.async_eval(y)
    mx.eval(y, *cache.arrays())
    cache.trim_rows([n] * B)  # back to where it was (see _drafting_cycle)
    return time.perf_counter() - t


def _drafting_cycles(pieces: ModelPieces, cache: ModelCache, head_cache: ModelCache, g: mx.array, rows: _Rows,
                     k: int, n: int) -> float:
    """n cycles of depth k, each queued on the device while the host builds the next -> seconds."""
    t = time.perf_counter()
    for _ in range(n):
        out = _drafting_cycle(pieces, cache, head_cache, g, rows, k)
        mx.async_eval(out)
    mx.eval(out)
    return time.perf_counter() - t


def _drafting_cycle(pieces: ModelPieces, cache: ModelCache, head_cache: ModelCache, g: mx.array, rows: _Rows,
                    k: int) -> list:
    """One drafting cycle's graph (queued by the caller): the head's pass over the last
    verify's state, k chained drafts as the proposer makes them, the verify and its accept step."""
    B = g.shape[0]
    ys = mx.zeros((B, 1), mx.int32)
    g = pieces.head(pieces.vocab.embed_tokens(ys), g, head_cache)
    drafts, q = chain(pieces.head, pieces.vocab, head_cache, g, k, rows.pick)
    mx.async_eval(drafts)
    inputs = mx.concatenate([ys, drafts], axis=1)
    with gdn_capture.record():
        logits, _ = adapter.forward(pieces.parts, inputs, cache, pieces.hidden_state)
    kept, tokens = rows.accept(logits, drafts, q, pieces.compiled)
    out = [kept, tokens, *cache.arrays()]
    # Attention caches back to where they were (the Gated DeltaNet state just moves on:
    # its cost does not depend on its values).
    cache.trim_rows([k + 1] * B)
    head_cache.trim_rows([k] * B)
    return out
