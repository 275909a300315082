"""Continuous batching with MTP speculative decoding.

Every `step()`:
  1. takes new requests and cancellations from a thread-safe inbox;
  2. advances one prefill chunk of the oldest waiting request (alone, B=1: long prompts
     never stall the others for more than a chunk), merging it into the batch when done;
  3. runs one decode cycle for all active rows together: the head chains k drafts per
     row, the main model verifies every row's k+1 tokens in ONE forward, and each row
     keeps its own number of drafts (ragged acceptance). Attention caches trim per row
     in O(1); Gated DeltaNet state is selected per row from the states recorded during
     the verify; no second forward.

One host synchronisation per cycle: drafts, verify and acceptance are built lazily and
evaluated together. B=1 is simply a batch of one (that is how `generate` runs).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx

from ..models import gdn_capture
from . import mlx_lm_adapter as adapter
from .adaptive import DepthPolicy
from .failures import CycleSnapshot, RowFailure, blame
from .limits import MAX_DRAFT_DEPTH
from .prefix_cache import PrefixCache
from .proposer import Segment, draft, drop_pending, head_pass, pending_array, pending_count
from .rejection_sampler import accept_greedy, accept_sampled, sample
from .request import Event, Request, RequestStats
from .sampling import RowSampler

log = logging.getLogger("mlxmtp")

ABSORB_AFTER = 64  # pending head inputs a row may accumulate while k = 0 before the head catches up
# While the policy stays at k = 0, a row keeps between KEEP_WHILE_PLAIN and FORGET_AFTER
# pending inputs (the older ones are dropped): a probe of drafting depths starts with a head
# pass over them, which on this CPU's quantized kernels costs ~0.12 plain steps per input
# (64 inputs: 7.7 steps; a probe into 64 pending inputs cost a 60-token request 13%).
KEEP_WHILE_PLAIN = 8
FORGET_AFTER = 16


@dataclass
class Row:
    req: Request
    sampler: RowSampler
    stop_ids: set
    tokens: List[int]  # prompt + generated: the processors' context
    stats: RequestStats
    detok: object
    y: int = -1  # last emitted token, not yet fed to the main model
    generated: int = 0
    text: str = ""
    sent: int = 0  # characters of text already emitted
    pend: List[Segment] = field(default_factory=list)  # pending head inputs (hidden states)
    pend_t: List[int] = field(default_factory=list)
    # prefill-only state (B=1) until the row joins the batch
    cache: Optional[list] = None
    head_cache: Optional[list] = None
    done_prompt: int = 0
    t0: float = 0.0
    last_logits: Optional[mx.array] = None
    first_lp: Optional[list] = None  # the first token's logprob table row (see _logprob_table)


@dataclass
class _Cycle:
    """One decode cycle's lazily built results, read by `_finish`."""

    rows: List[Row]
    k: int
    kept: mx.array  # [B] drafts kept per row
    tokens: mx.array  # [B, k+1]; row b emits tokens[b, : kept[b] + 1]
    lps: Optional[mx.array]  # [B, k+1, 1 + 2n] logprob tables (see _logprob_table), or None
    hidden: mx.array  # [B, k+1, H] head inputs
    records: list  # Gated DeltaNet per-position states of the verify
    t0: float
    pipelined: bool  # its input is the previous cycle's unread token
    synchronous: bool = False  # evaluated and read in the call that built it
    built: float = 0.0  # graph built (synchronous cycles)
    computed: float = 0.0  # device done (synchronous cycles)

    def select(self, keep: List[int]) -> "_Cycle":
        idx = mx.array(keep, dtype=mx.int32)
        return _Cycle([self.rows[i] for i in keep], self.k, self.kept[idx], self.tokens[idx],
                      None if self.lps is None else self.lps[idx], self.hidden[idx], self.records,
                      self.t0, self.pipelined)


class BatchGenerator:
    def __init__(self, model, tokenizer, *, enable_mtp: bool = True, num_draft: Optional[int] = None,
                 max_depth: int = MAX_DRAFT_DEPTH, max_batch: int = 16, prefill_step: int = 512,
                 prefix_cache_bytes: int = 0, acceptance_rule: str = "exact", profile: bool = False,
                 shape_stable: Optional[bool] = None):
        self.model = model
        self.tokenizer = tokenizer
        att = getattr(model, "mtp", None)
        if att is None:
            from ..models.family import text_parts

            self.parts, self.head, self.hidden_state = text_parts(model), None, "post_norm"
        else:
            self.parts, self.head, self.hidden_state = att.parts, att.head, att.hidden_state
        # What the drafter embeds and projects with (a float32 copy on the CPU for small tables).
        self.vocab = getattr(att, "vocab", None) or self.parts
        if not enable_mtp:
            self.head = None
        adapter.prepare_model(model)
        self.vocab_size = self.parts.args.vocab_size
        # Costs and acceptance belong to the model on this machine, not to one engine:
        # engines of the same model (e.g. successive `generate` calls) share what was learnt.
        policies = getattr(att, "policies", None) if att is not None else None
        key = (max_depth, num_draft)
        if policies is not None and key in policies:
            self.policy = policies[key]
        else:
            self.policy = DepthPolicy(max_depth=max_depth, fixed=num_draft)
            if policies is not None:
                policies[key] = self.policy
        self.max_depth = self.policy.max_depth  # the deepest pin a request may ask for
        self.max_batch = max_batch
        self.prefill_step = prefill_step
        self.acceptance_rule = acceptance_rule
        # profile: evaluate drafts on their own (one more sync per cycle) to split device
        # time into draft and verify; off by default, the split is for benchmarks.
        self.profile = profile
        # Shape-stable drafting cycles (see ragged_cache): what a GPU backend that plans or
        # compiles kernels per shape needs. Off by default on the CPU backend, which compiles
        # nothing per shape, and where attending over a whole buffer costs real work.
        self.shape_stable = mx.default_device() != mx.cpu if shape_stable is None else shape_stable
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.rows: List[Row] = []  # active, in batch order
        self.cache: Optional[list] = None
        self.head_cache: Optional[list] = None
        self.waiting: deque = deque()  # Rows not yet prefilled
        self._inbox: deque = deque()
        self._cancel: set = set()
        self._lock = threading.Lock()
        self.cycles = 0
        self.last_depth = 0
        self.why = ""  # why the last cycle got its depth (see _choose_depth)
        # Tests replace drafts through this hook to force chosen acceptance patterns
        # (drafts are verified, so any drafts give the same output): draft_hook(rows, drafts) -> drafts.
        self.draft_hook = None
        self._inflight: Optional[_Cycle] = None  # a pipelined plain-decoding cycle not read yet
        self._last_finish = 0.0
        # (mode, batch size) of the previous cycle's finish when the next finish can be timed
        # as the interval between the two; None after anything that is not a decode cycle.
        self._timing: Optional[tuple] = None
        self._draft_time = 0.0
        self._switched = False  # the cycle being launched is the first drafting one after plain decoding

    # ---------------------------------------------------------------- public, thread-safe
    def submit(self, req: Request) -> int:
        req.validate(self.vocab_size, self.max_depth)
        with self._lock:
            self._inbox.append(req)
        return req.id

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self._cancel.add(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self.waiting or self._inbox or self._inflight)

    @property
    def num_active(self) -> int:
        return len(self.rows)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._inbox)

    def skip_time(self, seconds: float) -> None:
        """Leave `seconds` the caller spent on other work between two steps out of the next
        cycle's cost (bench/decode.py runs mlx-lm and this engine in turns, chunk by chunk)."""
        self._last_finish += seconds

    # ---------------------------------------------------------------- the loop
    def step(self) -> List[Event]:
        events: List[Event] = []
        if self._inflight is not None and (self._inbox or self._cancel or self.waiting):
            self._drain(events)  # joins and cancellations change the batch: settle it first
        self._take_inbox(events)
        if self.waiting and len(self.rows) < self.max_batch:
            self._prefill(events)
            self._timing = None  # prefill time must not be billed to a decode cycle
        if self.rows:
            self._decode_cycle(events)
        return events

    def _take_inbox(self, events: List[Event]) -> None:
        with self._lock:
            new, self._inbox = list(self._inbox), deque()
            cancel, self._cancel = self._cancel, set()
        for req in new:
            try:
                with blame(req.id):
                    self.waiting.append(self._new_row(req))
            except RowFailure as f:
                events.append(_failed(req.id, f, None))
        if cancel:
            for r in [r for r in self.waiting if r.req.id in cancel]:
                self.waiting.remove(r)
                events.append(Event(r.req.id, [], "", "cancelled", stats=r.stats))
            gone = [i for i, r in enumerate(self.rows) if r.req.id in cancel]
            for i in gone:
                events.append(Event(self.rows[i].req.id, [], "", "cancelled", stats=self.rows[i].stats))
            self._drop_rows(gone)

    def _new_row(self, req: Request) -> Row:
        stop_ids = set(req.stop_token_ids if req.stop_token_ids is not None else self.tokenizer.eos_token_ids)
        return Row(req=req, sampler=RowSampler(req.params), stop_ids=stop_ids, tokens=list(req.prompt),
                   stats=RequestStats(prompt_tokens=len(req.prompt)), detok=self.tokenizer.detokenizer)

    # ---------------------------------------------------------------- prefill (B=1)
    def _prefill(self, events: List[Event]) -> None:
        """Short prompts first, each whole, then one chunk of the oldest long prompt.

        A prompt that fits in one chunk never waits behind a long one for more than that
        long prompt's current chunk, and a long prompt still advances every step. Chunks
        start at fixed offsets (multiples of `prefill_step`), whatever else is waiting, so
        a prompt's prefill computes the same numbers under any load."""
        budget = self.prefill_step
        for row in [r for r in self.waiting if _left(r) <= self.prefill_step]:
            if budget <= 0 or len(self.rows) >= self.max_batch:
                break
            budget -= _left(row)
            self._prefill_row(row, events, whole=True)
        long = next((r for r in self.waiting if _left(r) > self.prefill_step), None)
        if long is not None and len(self.rows) < self.max_batch:
            self._prefill_row(long, events, whole=False)

    def _prefill_row(self, row: Row, events: List[Event], whole: bool) -> None:
        """Advance `row`'s prefill by one chunk (or to its end), join it to the batch when
        its first token is out. A failure here is the row's alone (its caches are its own)."""
        try:
            with blame(row.req.id):
                ready = self._prefill_chunk(row)
                while whole and not ready:
                    ready = self._prefill_chunk(row)
                finished = ready and self._first_token(row, events)
        except RowFailure as f:
            self.waiting.remove(row)
            events.append(_failed(row.req.id, f, row.stats))
            return
        if ready:
            self.waiting.remove(row)
            if not finished:
                self._join_batch(row)

    def _prefill_chunk(self, row: Row) -> bool:
        """Feed `row`'s next prompt chunk; True once the whole prompt is in."""
        prompt = row.req.prompt
        if row.cache is None:
            row.t0 = time.perf_counter()
            self._start_prefill(row)
        # Like mlx-lm: chunks over prompt[:-1], then the last token alone.
        todo = len(prompt) - 1 - row.done_prompt
        if todo > 0:
            n = min(todo, self.prefill_step - row.done_prompt % self.prefill_step)
            self._prefill_tokens(row, prompt[row.done_prompt : row.done_prompt + n])
            row.done_prompt += n
            return False
        if row.done_prompt < len(prompt):
            logits = self._prefill_tokens(row, prompt[-1:])
            row.done_prompt = len(prompt)
            row.last_logits = logits[0, -1]
            self.prefix_cache.store(prompt, row.cache, row.head_cache, pending_array(row.pend), row.pend_t,
                                    row.last_logits)
        return True

    def _first_token(self, row: Row, events: List[Event]) -> bool:
        """Sample and emit the first token (from the prompt's last logits, as in plain
        decoding); True if that already finished the request."""
        row.stats.prefill_seconds = time.perf_counter() - row.t0
        first = self._sample_single(row, row.last_logits[None])
        row.y = first
        if self.head is not None:
            row.pend_t.append(first)
        return bool(self._emit(row, [first], events))

    def _start_prefill(self, row: Row) -> None:
        entry = self.prefix_cache.lookup(row.req.prompt) if self.prefix_cache.max_bytes > 0 else None
        if entry is not None and (self.head is None) == (entry.head_cache is None):
            row.cache = adapter.copy_cache(entry.cache)
            row.head_cache = adapter.copy_cache(entry.head_cache) if entry.head_cache is not None else None
            row.pend = [] if entry.pend_h is None else [(entry.pend_h, None, entry.pend_h.shape[0])]
            row.pend_t = list(entry.pend_t)
            row.done_prompt = len(entry.tokens)
            row.last_logits = entry.last_logits
            row.stats.cached_prompt_tokens = len(entry.tokens)
        else:
            row.cache = adapter.make_cache(self.parts, 1)
            row.head_cache = adapter.make_head_cache(self.head, 1) if self.head is not None else None

    def _prefill_tokens(self, row: Row, tokens: List[int]) -> mx.array:
        logits, hidden = adapter.forward(self.parts, mx.array(tokens)[None], row.cache, self.hidden_state)
        if self.head is not None:
            # Pair each new hidden with the token after it; absorb every complete pair.
            done = row.done_prompt
            nh = pending_count(row.pend)
            row.pend.append((hidden[0], None, len(tokens)))
            # Pending hiddens cover positions [done - nh, done + len(tokens)); each pairs
            # with the prompt token after it, where the prompt has one.
            row.pend_t = row.req.prompt[done - nh + 1 : done + len(tokens) + 1]
            n = len(row.pend_t)
            if n:
                _, rest = head_pass(self.head, self.vocab, row.head_cache, [row.pend], [row.pend_t], [n])
                row.pend, row.pend_t = rest[0], []
        mx.eval(logits, *adapter.cache_arrays(row.cache), *(adapter.cache_arrays(row.head_cache) if row.head_cache else []),
                *[a for a, _, _ in row.pend])
        return logits

    def _join_batch(self, row: Row) -> None:
        if self.cache is None:
            self.cache, self.head_cache = row.cache, row.head_cache
            # Verify forwards (and every head forward) in the shape-stable mode: a new
            # position or prompt length never makes a new shape; plain decoding (one token)
            # keeps mlx-lm's own attention call.
            if self.shape_stable:
                adapter.fix_shapes(self.cache, 2)
                if self.head_cache is not None:
                    adapter.fix_shapes(self.head_cache, 1)
        else:
            adapter.extend_cache(self.cache, row.cache)
            if self.head_cache is not None:
                adapter.extend_cache(self.head_cache, row.head_cache)
        row.cache = row.head_cache = None
        self.rows.append(row)

    def _drop_rows(self, gone: List[int]) -> None:
        if not gone:
            return
        keep = [i for i in range(len(self.rows)) if i not in set(gone)]
        self.rows = [self.rows[i] for i in keep]
        if self._inflight is not None:
            self._inflight = self._inflight.select(keep) if keep else None
        if not keep:
            self.cache = self.head_cache = None
            return
        adapter.filter_cache(self.cache, keep)
        if self.head_cache is not None:
            adapter.filter_cache(self.head_cache, keep)

    # ---------------------------------------------------------------- decode
    def _choose_depth(self) -> int:
        """The next cycle's depth; `self.why` says why (stats and /metrics report it)."""
        if self.head is None:
            self.why = "no MTP head"
            return 0
        # Drafting past a row's max_tokens is wasted but harmless (the stop truncates it);
        # capping by the row with the most room keeps one finishing row from stalling MTP.
        limit = max(r.req.max_tokens - r.generated - 1 for r in self.rows)
        pinned = [r.req.num_draft for r in self.rows if r.req.num_draft is not None]
        if pinned:  # a request that pins its depth gets it (the smallest pin wins in a batch)
            self.why = "pinned by a request"
            return max(0, min(min(pinned), limit))
        k = self.policy.choose(len(self.rows), limit, _acceptance_classes(self.rows))
        self.why = getattr(self.policy, "why", "")
        return k

    def _decode_cycle(self, events: List[Event]) -> None:
        k = self._choose_depth()
        for r in self.rows:
            r.stats.depth_reasons[self.why] = r.stats.depth_reasons.get(self.why, 0) + 1
        pipelined = k == 0 and all(not r.sampler.procs for r in self.rows)
        if self._inflight is not None and not pipelined:
            self._drain(events)
            if not self.rows:
                return
            # What this first cycle after a plain stretch costs beyond a steady one of its
            # depth (the head catches up on the pending inputs, nothing overlaps) is the
            # price of every switch; the policy weighs it against what a probe can teach.
            self._switched = k > 0
        snapshot = CycleSnapshot([self.cache, self.head_cache], [r.sampler for r in self.rows])
        try:
            rec = self._launch(k, self._inflight if pipelined else None)
        except RowFailure as f:
            snapshot.restore()  # undo the build, drop the row, rebuild next step without it
            self._fail_rows([f], events)
            return
        if not pipelined:
            # The caches are evaluated with the tokens: the work is due anyway, and leaving
            # it lazy would bill this cycle's cost to the next one (and skew the depth policy).
            rec.built, rec.synchronous = time.perf_counter(), True
            mx.eval(rec.kept, rec.tokens, *([rec.lps] if rec.lps is not None else []),
                    *adapter.cache_arrays(self.cache), *(adapter.cache_arrays(self.head_cache) if self.head_cache else []))
            rec.computed = time.perf_counter()
            self._finish(rec, events)
            return
        # Plain decoding, pipelined as mlx-lm does: this cycle's forward is queued on the
        # device before the previous cycle's tokens are read and emitted, so building
        # graphs and bookkeeping overlap the computation. A row that finished in the
        # previous cycle was fed one token too many here; it leaves, so nothing leaks.
        mx.async_eval(rec.tokens, *([rec.lps] if rec.lps is not None else []))
        prev, self._inflight = self._inflight, rec
        if prev is not None:
            self._finish(prev, events)

    def _drain(self, events: List[Event]) -> None:
        """Emit the cycle still in flight (before the batch changes shape)."""
        if self._inflight is not None:
            rec, self._inflight = self._inflight, None
            self._timing = None  # read early, so its interval means nothing
            self._finish(rec, events)
            self._timing = None

    def _launch(self, k: int, after: Optional["_Cycle"] = None) -> "_Cycle":
        """Build one cycle's graph: drafts, the verify forward and the acceptance, lazily."""
        t0 = time.perf_counter()
        rows, B = list(self.rows), len(self.rows)
        if after is not None:  # the previous (unread) cycle's tokens are this one's inputs
            ys = after.tokens[:, :1]
        else:
            ys = mx.array([r.y for r in rows], dtype=mx.int32)[:, None]
        q_rows: List[Optional[mx.array]] = [None] * B
        records = []
        if k > 0:
            drafts, q_rows = draft(self.head, self.vocab, self.head_cache, [r.pend for r in rows],
                                   [r.pend_t for r in rows], k, self._picker(rows))
            if self.draft_hook is not None:
                drafts = self.draft_hook(rows, drafts)
            if self.profile:
                t = time.perf_counter()
                mx.eval(drafts, *[q for q in q_rows if q is not None])
                self._draft_time = time.perf_counter() - t
            else:
                # The device computes the drafts while the host builds the verify's graph.
                mx.async_eval(drafts, *[q for q in q_rows if q is not None])
            inputs = mx.concatenate([ys, drafts], axis=1)
            with gdn_capture.record() as rec:
                logits, hidden = adapter.forward(self.parts, inputs, self.cache, self.hidden_state)
            records = rec.layers
        else:
            drafts = mx.zeros((B, 0), dtype=mx.int32)
            logits, hidden = adapter.forward(self.parts, ys, self.cache, self.hidden_state)
        kept, tokens, lps = self._accept(rows, logits, drafts, q_rows)
        return _Cycle(rows, k, kept, tokens.astype(mx.int32), lps, hidden, records, t0, after is not None)

    def _finish(self, rec: "_Cycle", events: List[Event]) -> None:
        """Read a cycle's results (the one host sync), emit, and roll every state back."""
        rows, k, B = rec.rows, rec.k, len(rec.rows)
        # k = 0 keeps nothing by definition: no device read (an unevaluated array read here
        # would wait behind the next cycle already queued on the device).
        kept_l = rec.kept.tolist() if k else [0] * B
        tok_l = rec.tokens.tolist()
        lp_l = rec.lps.tolist() if rec.lps is not None else None
        finished, consumed = [], []
        for b, row in enumerate(rows):
            emitted = tok_l[b][: kept_l[b] + 1]
            row.stats.record_cycle(k, kept_l[b], len(emitted))
            try:
                with blame(row.req.id):
                    n = self._emit(row, emitted, events, lp_l[b] if lp_l is not None else None)
            except RowFailure as f:  # its output failed (e.g. detokenizing): it ends here
                events.append(_failed(row.req.id, f, row.stats))
                n = len(emitted)
            consumed.append(n if n else len(emitted))
            if n:
                finished.append(b)
        # Roll back to exactly the tokens each row consumed (y plus the kept drafts).
        adapter.commit(self.cache, rec.records, consumed, k + 1)
        if self.head is not None:
            if k > 1:
                for c in self.head_cache:
                    c.trim_rows([k - 1] * B)
            for b, row in enumerate(rows):
                # The verify's hidden states paired with the tokens emitted after them.
                seg = (rec.hidden, b, consumed[b])
                if k > 0:
                    row.pend, row.pend_t = [seg], tok_l[b][: consumed[b]]
                else:
                    row.pend.append(seg)
                    row.pend_t = row.pend_t + tok_l[b][: consumed[b]]
            if k == 0:
                plain = getattr(self.policy, "regime", None) == 0
                most = max(len(r.pend_t) for r in rows)
                if plain and most > FORGET_AFTER:
                    self._forget_pending()
                elif not plain and most > ABSORB_AFTER:
                    self._absorb()
        for row in rows:
            row.y = row.tokens[-1]
        now = time.perf_counter()
        dt = now - max(rec.t0, self._last_finish)
        # A cycle's cost for the depth policy is the interval between two finishes of the
        # same kind (synchronous, or pipelined plain decoding) at the same batch size: it
        # includes all host work between cycles, alike for both kinds. The first cycle after
        # a switch of kind (a k = 0 stretch ends: the head catches up; drafting ends: the
        # first plain cycle is not overlapped) or a prefill is not timed.
        mode = ("sync" if rec.synchronous else "async", B)
        interval = now - self._last_finish
        self.policy.update(k, B, interval if self._timing == mode else None, kept_l, _acceptance_classes(rows),
                           switch_seconds=interval if self._switched else None)
        self._switched = False
        self._timing = mode
        self._last_finish = now
        self.cycles += 1
        self.last_depth = k
        device = (rec.computed - rec.built) if rec.computed else 0.0
        for row in rows:
            row.stats.decode_seconds += dt
            row.stats.device_seconds += device
            row.stats.overhead_seconds += dt - device - self._draft_time
            row.stats.draft_seconds += self._draft_time
        self._draft_time = 0.0
        if self.prefix_cache.max_bytes > 0 and not rec.pipelined and self._inflight is None:
            for b in finished:
                self._store_finished(b)
        self._drop_rows(finished)

    def _fail_rows(self, failures: List[RowFailure], events: List[Event]) -> None:
        ids = {f.request_id: f for f in failures}
        gone = [i for i, r in enumerate(self.rows) if r.req.id in ids]
        for i in gone:
            row = self.rows[i]
            events.append(_failed(row.req.id, ids[row.req.id], row.stats))
        self._drop_rows(gone)
        self._timing = None  # the interval to the next cycle includes the failed build

    def _forget_pending(self) -> None:
        """While the policy stays at plain decoding, drop all but the last KEEP_WHILE_PLAIN
        pending head inputs of every row instead of feeding them to the head.

        Keeping the head current costs a head pass per token: where drafting does not pay
        (this CPU's quantized kernels: 64 positions of the 4-bit demo head cost 7.7 plain
        steps) that is a ~12% tax on plain decoding for nothing. The head's cache then has
        a gap; drafts are verified, so a later probe or switch back to drafting loses at
        most some acceptance (the head still sees the recent positions), never exactness.
        """
        for r in self.rows:
            n = len(r.pend_t) - KEEP_WHILE_PLAIN
            if n > 0:
                r.pend, r.pend_t = drop_pending(r.pend, n), r.pend_t[n:]

    def _absorb(self) -> None:
        """Let the head consume all but the last pending pair of every row (k = 0 streaks)."""
        counts = [len(r.pend_t) - 1 for r in self.rows]
        if max(counts) <= 0:
            return
        _, rest = head_pass(self.head, self.vocab, self.head_cache, [r.pend for r in self.rows],
                            [r.pend_t for r in self.rows], counts)
        for r, n, left in zip(self.rows, counts, rest):
            r.pend, r.pend_t = left, r.pend_t[n:]

    def _store_finished(self, b: int) -> None:
        # The state covers every token but the last one emitted (never fed, as in plain decoding).
        row = self.rows[b]
        cache = adapter.extract_cache(self.cache, b)
        head_cache = adapter.extract_cache(self.head_cache, b) if self.head_cache is not None else None
        # Stored without logits: it only seeds longer prompts (the next turn of a conversation),
        # which prefill at least one more token anyway.
        toks = row.tokens[:-1]
        pend_t = row.pend_t[:-1] if self.head is not None else []
        pend_h = pending_array(row.pend) if self.head is not None else None
        if pend_h is not None:
            pend_h = pend_h[: len(pend_t) + 1]
        self.prefix_cache.store(toks, cache, head_cache, pend_h, pend_t, _NO_LOGITS)

    # ---------------------------------------------------------------- sampling
    def _contexts(self, row: Row, extra: mx.array, n: int) -> List[mx.array]:
        base = mx.array(row.tokens, dtype=mx.int32)
        return [mx.concatenate([base, extra[:j]]) for j in range(n)]

    def _picker(self, rows: List[Row]):
        plain = all(r.sampler.params.greedy and not r.sampler.procs for r in rows)

        def pick(step, logits, so_far):
            if plain:
                return mx.argmax(logits, axis=-1), [None] * len(rows)
            toks, qs = [], []
            for b, r in enumerate(rows):
                with blame(r.req.id):
                    tok, q = _pick_row(r, logits[b : b + 1], so_far[b])
                toks.append(tok)
                qs.append(q)
            return mx.stack(toks), qs

        return pick

    def _accept(self, rows: List[Row], logits: mx.array, drafts: mx.array, q_rows):
        """-> kept [B], tokens [B, k+1], logprobs of the emitted tokens [B, k+1] or None."""
        B, T = logits.shape[0], logits.shape[1]
        k = T - 1
        want_lp = any(r.req.logprobs is not None for r in rows)
        top_n = max((r.req.logprobs or 0) for r in rows)
        if all(r.sampler.params.greedy and not r.sampler.procs for r in rows):
            if k == 0:
                tokens = mx.argmax(logits, axis=-1)
                kept = mx.zeros((B,), dtype=mx.int32)
            else:
                kept, tokens = accept_greedy(logits, drafts)
            lps = _logprob_table(logits, tokens, top_n) if want_lp else None
            return kept, tokens, lps
        kepts, toks, lps = [], [], []
        for b, r in enumerate(rows):
            with blame(r.req.id):
                kb, tb, lb = self._accept_row(r, logits[b], drafts[b], q_rows[b], top_n if want_lp else None)
            kepts.append(kb)
            toks.append(tb)
            lps.append(lb)
        kept = mx.stack(kepts).astype(mx.int32) if k else mx.zeros((B,), dtype=mx.int32)
        return kept, mx.stack(toks), mx.stack(lps) if want_lp else None

    def _accept_row(self, r: Row, lg: mx.array, drafts: mx.array, q: Optional[mx.array], top_n: Optional[int]):
        """One row of a mixed batch: logits [T, V] -> (kept, tokens [T], logprob table or None)."""
        T = lg.shape[0]
        k, kept = T - 1, None
        if r.sampler.procs:
            lg = r.sampler.process(lg, self._contexts(r, drafts, T))
        if k == 0:
            tokens = mx.argmax(lg, axis=-1) if r.sampler.params.greedy else r.sampler.draw(lg)
        elif r.sampler.params.greedy:
            kept, tokens = accept_greedy(lg[None], drafts[None])
            kept, tokens = kept[0], tokens[0]
        else:
            kept, tokens = accept_sampled(r.sampler.logprobs(lg), q, drafts, r.sampler.next_key(),
                                          rule=self.acceptance_rule)
        tokens = tokens.astype(mx.int32)
        table = _logprob_table(lg[None], tokens[None], top_n)[0] if top_n is not None else None
        return kept, tokens, table

    def _sample_single(self, row: Row, logits: mx.array) -> int:
        lg = logits
        if row.sampler.procs:
            lg = row.sampler.process(lg, [mx.array(row.tokens, dtype=mx.int32)])
        if row.sampler.params.greedy:
            tok = mx.argmax(lg, axis=-1)
        else:
            tok = row.sampler.draw(lg)
        if row.req.logprobs is not None:
            row.first_lp = _logprob_table(lg, tok, row.req.logprobs)[0].tolist()
        return int(tok.item())

    # ---------------------------------------------------------------- output
    def _emit(self, row: Row, tokens: List[int], events: List[Event], lps=None) -> int:
        """Append tokens to a row and queue its event. Returns 0 while the row goes on, else
        how many of `tokens` it consumed before finishing (the rest are never emitted)."""
        out, reason = [], None
        stops = row.req.stop
        for t in tokens:
            row.tokens.append(t)
            row.generated += 1
            row.stats.generated_tokens += 1
            out.append(t)
            if t in row.stop_ids:
                reason = "stop"
                break
            row.detok.add_token(t)
            if stops and _find_stop(row.detok.text, stops) is not None:
                reason = "stop"
                break
            if row.generated >= row.req.max_tokens:
                reason = "length"
                break
        if reason is not None:
            row.detok.finalize()
        text = row.detok.text
        if stops and (hit := _find_stop(text, stops)) is not None:
            text = text[:hit]
            reason = reason or "stop"
        # Hold back text that could still grow into a stop string.
        hold = 0 if reason is not None else max((len(s) - 1 for s in stops), default=0)
        upto = max(row.sent, len(text) - hold)
        delta, row.sent = text[row.sent : upto], upto
        row.text = text
        lp_list = None
        if row.req.logprobs is not None:
            tables = lps if lps is not None else [row.first_lp]
            lp_list = [_logprob_entry(t, table, row.req.logprobs) for t, table in zip(out, tables)]
        events.append(Event(row.req.id, out, delta, reason, logprobs=lp_list,
                            stats=row.stats if reason else None))
        return len(out) if reason else 0


_NO_LOGITS = mx.zeros((0,))


def _left(row: Row) -> int:
    """Prompt tokens not yet prefilled."""
    return len(row.req.prompt) - row.done_prompt


def _failed(request_id: int, failure: RowFailure, stats: Optional[RequestStats]) -> Event:
    log.warning("request %d failed: %s", request_id, failure)
    return Event(request_id, [], "", "error", error=f"generation failed: {failure}", stats=stats)


def _pick_row(r: Row, logits: mx.array, so_far: mx.array):
    """One draft of one row from the head's logits [1, V]: (token, q log-probs or None)."""
    if r.sampler.procs:
        ctx = mx.concatenate([mx.array(r.tokens, dtype=mx.int32), so_far])
        logits = r.sampler.process(logits, [ctx])
    if r.sampler.params.greedy:
        return mx.argmax(logits, axis=-1)[0], None
    lp = r.sampler.logprobs(logits)
    return sample(lp, r.sampler.next_key())[0], lp[0]


def _acceptance_classes(rows: List[Row]) -> List[str]:
    # Greedy rows keep a draft only if it is the argmax; sampled rows by rejection sampling,
    # which keeps far more deep drafts: the depth policy learns the two apart.
    return ["greedy" if r.sampler.params.greedy else "sampled" for r in rows]


def _find_stop(text: str, stops: List[str]) -> Optional[int]:
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def _logprob_table(logits: mx.array, tokens: mx.array, top_n: int) -> mx.array:
    """logits [..., V], chosen tokens [...] -> [..., 1 + 2 * top_n] float32: the chosen
    token's log-probability, then the ids of the top_n most likely tokens (most likely
    first; float32 holds ids below 2**24 exactly), then their log-probabilities.

    One array, so a cycle's tables are selected, evaluated and read with its tokens."""
    lp = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(mx.float32)
    chosen = mx.take_along_axis(lp, tokens[..., None].astype(mx.int32), axis=-1)
    if not top_n:
        return chosen
    top = mx.argpartition(-lp, top_n - 1, axis=-1)[..., :top_n]
    top_lp = mx.take_along_axis(lp, top, axis=-1)
    order = mx.argsort(-top_lp, axis=-1)
    top, top_lp = mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(top_lp, order, axis=-1)
    return mx.concatenate([chosen, top.astype(mx.float32), top_lp], axis=-1)


def _logprob_entry(token: int, table: list, top_n: int) -> dict:
    """One emitted token's row of a _logprob_table -> {"token", "logprob", "top": [(id, lp)]}."""
    width = (len(table) - 1) // 2
    ids, values = table[1 : 1 + width], table[1 + width :]
    return {"token": token, "logprob": float(table[0]),
            "top": [(int(i), float(v)) for i, v in zip(ids[:top_n], values[:top_n])]}
