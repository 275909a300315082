"""Continuous batching with MTP speculative decoding: `BatchGenerator`, the engine's loop.

Every `step()`:
  1. takes new requests and cancellations from a thread-safe inbox (scheduler.py);
  2. prefills waiting prompts alone (B=1), in chunks, and merges each into the batch
     when its first token is out (prefill.py);
  3. runs one decode cycle for all active rows together (cycle.py): the drafter proposes k
     drafts per row (proposers/), the main model verifies every row's k+1 tokens in
     ONE forward, each row keeps its own number of drafts (sampling/), its tokens become
     text and events (output.py), and every cache is rolled back to what each row kept.

One host synchronisation per cycle: drafts, verify and acceptance are built lazily and
evaluated together. Cycles are pipelined where they can be (cycle.py): the next one is
queued on the device before the previous one is read. B=1 is simply a batch of one (that
is how `generate` runs).

The rest of the engine, one job a file: state.py (a request's Row; the Batch of active
rows and their caches), proposers/ (the drafters behind one interface: the MTP head),
timing.py (what a cycle cost, for the depth policy and the stats), failures.py (one
request's failing code fails that request only), pieces.py (what runs of the model).
"""

from __future__ import annotations

import time
from collections import deque
from typing import List, Optional, Set

import mlx.core as mx

from . import cycle, memory, scheduler
from .config import EngineConfig
from .cycle import Cycle
from .failures import CycleSnapshot, RowFailure
from .output import emit_cycle
from .parts import EngineParts, make_parts
from .pieces import cycle_modes
from .policy import calibration
from .prefill import Prefiller
from .proposers.build import build_proposer
from .request import Event, Request
from .sampling.batch import BatchSampling
from .state import Batch, Row, new_row, to_resume
from .timing import CycleClock


class BatchGenerator:
    def __init__(self, model, tokenizer, config: EngineConfig = EngineConfig(), parts: Optional[EngineParts] = None):
        self.model, self.tokenizer = model, tokenizer
        self.config = config  # as given: what the ranks of a distributed run compare
        parts = parts or make_parts(model, config)  # engine/build.py; None: a process alone's
        c, self.coordinator = parts.settings, parts.coordinator
        self.policy, self.saved = parts.policy, parts.saved
        self.max_depth = self.policy.max_depth  # the deepest pin a request may ask for
        self.max_batch, self.acceptance_rule = c.max_batch, c.acceptance_rule
        self.profile = c.profile  # drafts evaluated on their own, to split device time (for benchmarks)
        self.pieces = parts.pieces
        # The drafter (None: plain decoding); it reads the policy in use (tests replace it).
        self.proposer = build_proposer(self.pieces, self)
        pipelines = c.pipeline_drafts and (self.proposer is None or self.proposer.pipelines)
        self.shape_stable, self.pipeline_drafts = cycle_modes(c.shape_stable, pipelines, c.profile)
        self.vocab_size = self.pieces.parts.args.vocab_size
        self.prefix_cache = parts.prefix_cache
        self.prefiller = Prefiller(self.pieces, self.prefix_cache, c.prefill_step)
        self.memory = parts.memory  # running rows and the prefix cache within the memory budget
        self.batch = Batch(self.shape_stable, head_width=self.max_depth + 1)
        self.waiting: deque = deque()  # Rows not yet prefilled
        self.inbox = scheduler.Inbox()
        self.clock = CycleClock()
        self.cycles = self.last_depth = 0
        self.why = ""  # why the last cycle got its depth (see cycle.choose_depth)
        # Tests force acceptance patterns through it (drafts are verified: any give the same
        # output): draft_hook(rows, drafts, unread) -> drafts; unread: None, or [B] tokens each
        # row emits in a cycle not read yet (a drafting cycle built on an unread one).
        self.draft_hook = None
        self._inflight: Optional[Cycle] = None  # a pipelined cycle not read yet

    # ---------------------------------------------------------------- public, thread-safe
    def submit(self, req: Request) -> int:
        req.validate(self.vocab_size, self.max_depth)
        self.inbox.put(req)
        return req.id

    def cancel(self, request_id: int) -> None:
        self.inbox.cancel(request_id)

    # ---------------------------------------------------------------- public, engine thread
    @property
    def has_work(self) -> bool:
        return bool(self.rows or self.waiting or len(self.inbox) or self._inflight)

    @property
    def num_active(self) -> int:
        return len(self.rows)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.inbox)

    @property
    def rows(self) -> List[Row]:
        """The active rows, in batch order."""
        return self.batch.rows

    @property
    def cache(self) -> Optional[list]:
        return self.batch.cache

    @property
    def head_cache(self) -> Optional[list]:
        return self.batch.head_cache

    def skip_time(self, seconds: float) -> None:
        """Leave `seconds` spent on other work between two steps out of the next cycle's cost (bench/decode.py)."""
        self.clock.skip(seconds)

    def unstarted_request_ids(self) -> Set[int]:
        """Requests whose prefill has not started (in the inbox, or waiting without prefill state: a row sent
        back to wait has emitted tokens); after a failed step, these alone can be resubmitted untouched."""
        waiting = {r.req.id for r in self.waiting if r.cache is None and not r.resuming}
        return waiting | {req.id for req in self.inbox.requests()}

    def cancelled_ids(self) -> Set[int]:
        """Cancellations submitted but not yet applied."""
        return self.inbox.cancelled_ids()

    def set_fatal_handler(self, handler) -> None:
        """Nothing: a failing step leaves this engine to be rebuilt (server/engine_thread.py)."""

    def close(self) -> None:
        """Keep what the depth policy learnt (policy/saved.py); this engine runs alone."""
        self.saved.save(self.policy, force=True)

    def flush(self) -> List[Event]:
        """Read and emit the cycle in flight, if any: the caches then hold every token each row emitted but its last."""
        events: List[Event] = []
        self._drain(events)
        return events

    # ---------------------------------------------------------------- the loop
    def step(self) -> List[Event]:
        """One turn of the loop -> the events it produced (tokens, finishes, failures)."""
        events: List[Event] = []
        if self._inflight is not None and (self.inbox.has_changes or self.waiting):
            self._drain(events)  # joins and cancellations change the batch: settle it first
        new, cancelled = self.inbox.take()
        scheduler.admit(new, self._new_row, self.waiting, events)
        self._drop_rows(scheduler.cancel(cancelled, self.waiting, self.rows, events, self.prefiller.keep_partial))
        if self._inflight is not None and self.waiting:
            # Submitted between the check above and the take: settle the batch (a cycle in flight feeds its rows only).
            self._drain(events)
        if self.waiting and len(self.rows) < self.max_batch:
            allowed = memory.startable(self.memory, self.rows, self.waiting)
            self.prefiller.run(self.waiting, self.batch, self.max_batch, events, allowed)
            self.clock.untimed()  # prefill time must not be billed to a decode cycle
        if self.rows:
            self._decode_cycle(events)
        self.saved.save(self.policy, force=not self.has_work)  # now and then, and whenever out of work
        return events

    def _new_row(self, req: Request) -> Row:
        return new_row(req, self.tokenizer)

    def _drop_rows(self, gone: List[int]) -> None:
        keep = self.batch.drop(gone)
        if keep is not None and self._inflight is not None:
            self._inflight = self._inflight.select(keep) if keep else None
        if self.proposer is not None:  # a finished request's output joins the suffix index now
            self.proposer.drop_absent({r.req.id for r in self.rows})
        memory.after_drop(self.memory, self.rows, self.waiting)

    # ---------------------------------------------------------------- decode
    def calibrate(self, batch_size: int = 1, progress=None, kinds=calibration.COST_KINDS) -> bool:
        """Measure cycle costs of `kinds` of batches at `batch_size` rows if the policy has none yet
        (policy/calibration.py) -> whether it ran; later sizes and kinds learn from their own cycles."""
        if self.pieces.head is None or not self.policy.needs_costs(batch_size):
            return False
        calibration.seed_policy(self.policy, self.pieces, batch_size, self.shape_stable, self.pipeline_drafts,
                                progress, kinds)
        self.saved.load_into(self.policy)  # what an earlier run learnt, on top of this run's priors
        self.clock.untimed()
        return True

    def _decode_cycle(self, events: List[Event]) -> None:
        if memory.overflow(self.memory, self.rows, self.waiting):
            self._make_room(events)
            if not self.rows:
                return
        if self.policy.needs_costs(len(self.rows)):  # the first cycle only: its batch's kind
            self.calibrate(len(self.rows), kinds=[cycle.cost_kind_of(self.rows)])
        k, self.why = cycle.choose_depth(self.policy, self.rows, self.proposer)
        for r in self.rows:
            r.stats.depth_reasons[self.why] = r.stats.depth_reasons.get(self.why, 0) + 1
        pipelined = cycle.can_pipeline(self.rows, k, self.pipeline_drafts, self.proposer)
        prev = self._inflight
        if prev is not None and not (pipelined and (prev.k > 0) == (k > 0)):
            self._drain(events)
            if not self.rows:
                return
            # The first drafting cycle after plain decoding: what it costs beyond a steady
            # cycle of its depth is the price of a switch (see timing).
            self.clock.switched = k > 0 and prev.k == 0
            prev = None
        snapshot = CycleSnapshot([self.cache, self.head_cache], [r.sampler for r in self.rows])
        try:
            rec = self._launch(k, prev)
        except RowFailure as f:
            snapshot.restore()  # undo the build, drop the row, rebuild next step without it
            self._drop_rows(scheduler.fail([f], self.rows, events))
            self.clock.untimed()  # the interval to the next cycle includes the failed build
            return
        if not pipelined:
            cycle.evaluate(rec, self.batch)
            self._finish(rec, events)
            return
        # As mlx-lm decodes: this cycle is queued on the device before the previous one's
        # tokens are read and emitted, so building graphs and bookkeeping overlap the
        # computation. A row that finished in the previous cycle was fed too far here; it
        # leaves, so nothing leaks.
        cycle.start(rec)
        self._inflight = rec
        if prev is not None:
            self._finish(prev, events, rolled_back=prev.k > 0)

    def _make_room(self, events: List[Event]) -> None:
        """Send the newest rows back to wait, to resume when they fit (engine/memory.py)."""
        self._drain(events)  # every row's caches then hold all its tokens but the last
        n = memory.overflow(self.memory, self.rows, self.waiting)
        rows = self.rows[len(self.rows) - n:]
        self._drop_rows(list(range(len(self.rows) - n, len(self.rows))))
        self.waiting.extendleft(to_resume(r) for r in reversed(rows))
        self.memory.preempted += n
        self.clock.untimed()

    def _drain(self, events: List[Event]) -> None:
        """Emit the cycle still in flight (before the batch changes shape)."""
        if self._inflight is not None:
            rec, self._inflight = self._inflight, None
            self.clock.untimed()  # read early, so its interval means nothing
            self._finish(rec, events)
            self.clock.untimed()

    def _launch(self, k: int, after: Optional[Cycle] = None) -> Cycle:
        """Build one cycle's graph lazily (drafts, the verify forward, the acceptance) after `after`: the
        previous cycle, still unread (pipelined), or None."""
        rows = list(self.rows)
        sampling = BatchSampling.for_rows(rows)  # decided once: the drafts and the accept step read it
        if k > 0 and after is not None:
            return cycle.launch_after(self.pieces, self.batch, after, k, self.proposer, self._picker(sampling),
                                      self.draft_hook, self.acceptance_rule, sampling)
        t0 = time.perf_counter()
        ys = cycle.first_inputs(rows, after)
        drafts, q = self._propose(rows, k, sampling)
        drafted = self.proposer.drafted(len(rows), k) if k else None
        return cycle.verify(self.pieces, self.cache, rows, ys, drafts, q, self.acceptance_rule, t0,
                            after is not None, sampling, drafted)

    def _propose(self, rows: List[Row], k: int, sampling: BatchSampling):
        """k drafts per row -> (drafts [B, k], the q log-probs [B, k, V] or None: all greedy)."""
        if k == 0:
            return mx.zeros((len(rows), 0), dtype=mx.int32), None
        drafts, q = self.proposer.propose(self.batch, rows, k, self._picker(sampling))
        if self.draft_hook is not None:
            drafts = self.draft_hook(rows, drafts, None)
        if self.profile:
            self.clock.draft_time = cycle.wait_for_drafts(drafts, q)
        else:
            # The device computes the drafts while the host builds the verify's graph.
            mx.async_eval(drafts, *([q] if q is not None else []))
        return drafts, q

    def _picker(self, sampling: BatchSampling):
        """How each draft of the cycle is decided (a test overrides it to draft from chosen q)."""
        return sampling.pick

    def _read(self, rec: Cycle):
        """The cycle's results on the host, shown to the coordinator (ranks check they agree)."""
        kept, tokens, tables = cycle.read(rec)
        self.coordinator.after_cycle(kept, tokens)
        return kept, tokens, tables

    def _finish(self, rec: Cycle, events: List[Event], rolled_back: bool = False) -> None:
        """Read a cycle's results (the one host sync), emit, and roll every state back;
        `rolled_back`: the drafting cycle built on top of it did that on the device (and fed
        the head), only the trims it deferred are left to settle."""
        kept, tokens, tables = self._read(rec)
        consumed, finished = emit_cycle(rec.rows, rec.k, kept, tokens, tables, events, rec.drafted)
        if rolled_back:
            cycle.settle(rec, self.batch, self.proposer, kept)
        else:
            cycle.roll_back(rec, self.batch, consumed)
            if self.proposer is not None:  # what the drafter learns from the cycle
                self.proposer.after_verify(self.batch, rec, tokens, consumed)
        for row in rec.rows:
            row.y = row.tokens[-1]
        self.clock.finish(rec, self.policy, kept, cycle.keep_chances(rec))
        self.cycles += 1
        self.last_depth = rec.k
        scheduler.store_finished(self.prefix_cache, self.batch, finished, rec.k, self._inflight)
        self._drop_rows(finished)
