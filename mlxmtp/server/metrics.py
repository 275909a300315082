"""Prometheus metrics, one CollectorRegistry per app (tests build several apps)."""

from __future__ import annotations

import functools
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..engine.memory import MemoryGuard
from ..engine.prefix.cache import PrefixCache

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        p = "mlxmtp_"
        self.requests = Counter(p + "requests", "HTTP requests by endpoint and status.", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generated_tokens = Counter(p + "generated_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Request arrival to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time per generated token after the first.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Gauge(p + "queue_length", "Requests waiting for a batch slot or prefill.", registry=r)
        self.batch = Gauge(p + "batch_size", "Requests decoding together.", registry=r)
        self._add_drafting(p, r)
        self.engine_errors = Counter(p + "engine_errors", "Engine steps that raised.", registry=r)
        self.cached_prompt_tokens = Counter(p + "cached_prompt_tokens", "Prompt tokens restored from the prefix "
                                            "cache instead of prefilled.", registry=r)
        self.prefix_cache_bytes = Gauge(p + "prefix_cache_bytes", "Bytes the prefix cache holds.", registry=r)
        self.prefix_cache_entries = Gauge(p + "prefix_cache_entries", "States the prefix cache holds.",
                                          registry=r)
        self.prefix_cache_lookups = Gauge(p + "prefix_cache_lookups", "Prefix cache lookups by result, since the "
                                          "engine started: hit, miss; disk: the hits that loaded their state from "
                                          "disk (--prefix-cache-dir); rejected: states found on disk but not used "
                                          "(unreadable, gone, not exactly what was written, or not of the model's "
                                          "shapes), each deleted.", ["result"], registry=r)
        self.prefix_disk_bytes = Gauge(p + "prefix_cache_disk_bytes", "Bytes of files the prefix cache keeps on "
                                       "disk (--prefix-cache-dir).", registry=r)
        self.prefix_disk_entries = Gauge(p + "prefix_cache_disk_entries", "States the prefix cache keeps on disk.",
                                         registry=r)
        self.memory_budget = Gauge(p + "memory_budget_bytes", "What the caches of running requests and the "
                                   "prefix cache may hold together (0: unbounded).", registry=r)
        self.memory_running = Gauge(p + "memory_running_bytes", "What the caches of running requests take, "
                                    "as the memory guard counts them.", registry=r)
        self.memory_preempted = Gauge(p + "memory_preempted_requests", "Running requests sent back to wait "
                                      "for memory, since the engine started.", registry=r)
        self.suffix_shared_tokens = Gauge(p + "suffix_shared_tokens", "Tokens of finished requests' outputs the "
                                          "suffix drafter drafts from (bounded; --no-suffix-share: none).",
                                          registry=r)
        self.suffix_shared_bytes = Gauge(p + "suffix_shared_bytes", "Bytes the suffix drafter's index of "
                                         "finished requests' outputs holds.", registry=r)
        self._pos_totals: dict = {}

    def _add_drafting(self, p: str, r: CollectorRegistry) -> None:
        """The drafts: made and kept, by drafter and by position; cycles by depth and reason."""
        self.drafted = Counter(p + "mtp_drafted_tokens", "Tokens drafted (the MTP head's and the suffix "
                               "drafter's).", registry=r)
        self.accepted = Counter(p + "mtp_accepted_tokens", "Drafted tokens the model accepted.", registry=r)
        self.drafted_by = Counter(p + "drafted_tokens_by_source", "Tokens drafted, by drafter (mtp, suffix).",
                                  ["source"], registry=r)
        self.accepted_by = Counter(p + "accepted_tokens_by_source", "Drafted tokens accepted, by drafter.",
                                   ["source"], registry=r)
        self.drafted_pos = Counter(p + "mtp_drafted_by_position", "Drafts reached, by draft position.",
                                   ["position"], registry=r)
        self.accepted_pos = Counter(p + "mtp_accepted_by_position", "Drafts accepted, by draft position.",
                                    ["position"], registry=r)
        self.acceptance_pos = Gauge(p + "mtp_acceptance_by_position",
                                    "Cumulative acceptance rate by draft position.", ["position"], registry=r)
        self.depth = Counter(p + "mtp_depth_cycles", "Decode cycles by chosen draft depth.", ["depth"],
                             registry=r)
        self.depth_reason = Counter(p + "mtp_depth_decisions", "Decode cycles by depth and the reason the depth "
                                    "policy gave for it.", ["depth", "reason"], registry=r)
        self.last_depth = Gauge(p + "mtp_depth", "Draft depth chosen for the latest decode cycle.", registry=r)

    def watch_prefix_cache(self, current: Callable[[], Optional[PrefixCache]]) -> None:
        """Read the prefix cache's size and lookups at each scrape (not per decode step);
        `current()`: the running engine's PrefixCache, or None."""
        read = functools.partial(_read_at_scrape, current)
        self.prefix_cache_bytes.set_function(read(lambda c: c.bytes))
        self.prefix_cache_entries.set_function(read(lambda c: len(c.entries)))
        self.prefix_cache_lookups.labels("hit").set_function(read(lambda c: c.hits))
        self.prefix_cache_lookups.labels("miss").set_function(read(lambda c: c.misses))
        # "disk": the hits that loaded their state from disk.
        self.prefix_cache_lookups.labels("disk").set_function(read(lambda c: c.disk.loads if c.disk else 0))
        # "rejected": states found on disk for a prompt that failed their checks (each deleted;
        # the lookup goes on without them).
        self.prefix_cache_lookups.labels("rejected").set_function(read(lambda c: c.disk.rejected if c.disk else 0))
        self.prefix_disk_bytes.set_function(read(lambda c: c.disk.bytes if c.disk else 0))
        self.prefix_disk_entries.set_function(read(lambda c: len(c.disk.entries) if c.disk else 0))

    def watch_memory(self, current: Callable[[], Optional[MemoryGuard]]) -> None:
        """Read the memory guard at each scrape; `current()`: the running engine's, or None."""
        read = functools.partial(_read_at_scrape, current)
        self.memory_budget.set_function(read(lambda g: g.budget))
        self.memory_running.set_function(read(lambda g: g.running))
        self.memory_preempted.set_function(read(lambda g: g.preempted))

    def watch_suffix_index(self, current: Callable[[], Optional[object]]) -> None:
        """Read the suffix drafter's shared index (suffix_index.SharedOutputs) at each
        scrape; `current()`: the running engine's, or None."""
        read = functools.partial(_read_at_scrape, current)
        self.suffix_shared_tokens.set_function(read(lambda s: s.tokens))
        self.suffix_shared_bytes.set_function(read(lambda s: s.nbytes))

    def on_step(self, engine, decoded: bool) -> None:
        """From the engine thread after every step."""
        self.queue.set(engine.num_waiting)
        self.batch.set(engine.num_active)
        if decoded:
            self.depth.labels(str(engine.last_depth)).inc()
            self.depth_reason.labels(str(engine.last_depth), engine.why).inc()
            self.last_depth.set(engine.last_depth)

    def on_finish(self, stats) -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated_tokens.inc(stats.generated_tokens)
        self.cached_prompt_tokens.inc(stats.cached_prompt_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        for source, (d, a) in stats.by_source.items():
            self.drafted_by.labels(source).inc(d)
            self.accepted_by.labels(source).inc(a)
        for i, (d, a) in enumerate(zip(stats.drafted_by_position, stats.accepted_by_position, strict=True)):
            pos = str(i + 1)
            self.drafted_pos.labels(pos).inc(d)
            self.accepted_pos.labels(pos).inc(a)
            td, ta = self._pos_totals.get(pos, (0, 0))
            td, ta = td + d, ta + a
            self._pos_totals[pos] = (td, ta)
            self.acceptance_pos.labels(pos).set(ta / td if td else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _read_at_scrape(current: Callable[[], Optional[object]], field: Callable[[object], int]) -> Callable[[], float]:
    """A gauge's value function: `field` of what `current()` returns then (0 while it is None)."""

    def value() -> float:
        obj = current()
        return float(field(obj)) if obj is not None else 0.0
    return value
