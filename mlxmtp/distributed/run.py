"""`mlxmtp generate` on every rank of a distributed run: rank 0 generates and reports,
the other ranks follow its steps."""

from __future__ import annotations

from typing import Optional

from ..checkpoint.split_plan import Plan
from ..engine.config import EngineConfig
from ..engine.generate import GenerationResult, generate
from .engine import DistributedEngine
from .load import bytes_per_rank


def generate_on_ranks(group, plan: Plan, model, tok, ids, *, dist_timeout: float, config: EngineConfig,
                      **generate_options) -> Optional[GenerationResult]:
    """Rank 0: the result (`generate_options` as engine.generate takes them), with
    `distributed`, what `generate --json` reports as `stats.distributed`: the split, the
    bytes each rank holds and its peak memory after loading, the control messages. Other
    ranks: None, once rank 0 is done."""
    loaded, peaks = bytes_per_rank(group, model)  # peaks: after loading, before decoding
    engine = DistributedEngine(model, tok, config, group=group, dist_timeout=dist_timeout)
    if not engine.leader:
        engine.follow()
        return None
    try:
        engine.calibrate(1)  # every rank, watched by its progress (the first step's would not be)
        res = generate(model, tok, ids, engine=engine, **generate_options)
    finally:
        engine.close()
    res.distributed = {"ranks": group.size(), "split": plan.split, "layers": [r.layers for r in plan.ranks],
                       "bytes_per_rank": loaded, "planned_bytes_per_rank": [r.bytes for r in plan.ranks],
                       "load_peak_bytes_per_rank": peaks, "control_messages": engine.channel.messages,
                       "control_bytes": engine.channel.bytes_sent}
    return res
