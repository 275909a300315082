"""What the depth policy learnt, kept on disk for the next run of the same model here.

A policy starts knowing nothing of a batch size: its table measures plain decoding against a
drafting depth in calibration blocks, probes the other depths, and the head's acceptance is
learnt, all on real requests (BENCHMARKS.md: four rows of agents on an Apple GPU's estimated
costs lose ~10% in their first rounds). A server restarted, or `mlxmtp generate` run again,
would pay that again. So what a long-running server would still know is written to a file
and read back once, right after the start-up calibration (whose priors stay this run's):
per cost table, the latest ratios of neighbouring cycles, the machine's noise and the anchor
depth; the switch's costs; the head's acceptance counts per class and depth.
Read back, it is a starting point, not a verdict: live cycles go on replacing it as they
would in a server that never stopped (windows of the latest ratios, decaying counts).

The file is `<folder>/<fingerprint>.json`; the fingerprint covers everything the figures
depend on (the model's files, mlxmtp, mlx and mlx-lm, the device and machine, the settings
that shape a cycle). Nothing read is trusted: a file whose checksum, format or fingerprint does
not match, or with any value out of range, is ignored whole (the policy starts cold; a
warning is logged). A file is written whole under a temporary name, synced and renamed into place
(prefix/files.write_atomically, with the prefix cache's sealed JSON: prefix/check.seal); this
module replaces only its own files and deletes nothing.

Written here: mlx-lm and the libraries we use keep no such state.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import time
from collections import Counter, deque
from pathlib import Path
from typing import Hashable, Optional

import mlx.core as mx

from ... import __version__
from ..limits import MAX_CYCLE_DEPTH
from ..prefix import check as prefix_check
from ..prefix import files as prefix_files
from ..prefix import folders
from .base import COST_KINDS, REPRODUCIBLE, Opening

log = logging.getLogger("mlxmtp")

FORMAT = 1  # bump when the layout below changes: older files are then ignored
# Seconds between saves while the engine has work (and one whenever it runs out, and at close):
# a save stalls the engine's thread for milliseconds (BENCHMARKS.md, a server restarted), and a
# restart loses at most this much learning.
SAVE_EVERY = 120.0
MAX_BYTES = 16 << 20  # a file larger than this is not one this module wrote
MAX_LOG_RATIO = 10.0  # a cost ratio beyond e^10 either way is not a measurement
KINDS = (*COST_KINDS, REPRODUCIBLE)  # the acceptance classes' kinds


def state_of(policy) -> dict:
    """What `policy` (adaptive.DepthPolicy) has learnt, as JSON-able data."""
    tables = [{"bucket": b, "kind": kind, "pairs": [[j, k, list(w)] for (j, k), w in t.pairs.items()],
               "jitter": list(t.jitter), "anchor": policy.anchors.get((b, kind)),
               "switch": list(policy.switch.samples.get((b, kind), []))}
              for (b, kind), t in policy.costs.items()]
    counts, first = policy.accept.learnt()
    return {"tables": tables,
            "acceptance": [{"class": _class_out(cls), "depth": k, "kept": kept, "tried": tried}
                           for (cls, k), (kept, tried) in counts.items() if cls is not None],
            "first_drafts": [{"class": _class_out(cls), "n": n} for cls, n in first.items() if cls is not None]}


def restore(policy, state: dict) -> None:
    """Put `state` (state_of's) into `policy`, which has measured nothing live yet; raises
    ValueError, leaving `policy` as it was, where anything in it is not what state_of writes.
    A table's start-up calibration (its priors) stays this run's."""
    tables = [_table(t, policy) for t in _list(state, "tables")]
    counts = dict(_counts(c, policy.max_depth) for c in _list(state, "acceptance"))
    first = Counter()
    for f in _list(state, "first_drafts"):
        first[_class_in(f.get("class"))] += _count(f.get("n"))
    for key, pairs, jitter, anchor, switch in tables:
        policy._costs(key).restore(pairs, jitter)
        if anchor is not None:
            policy.anchors[key] = anchor
        if switch:
            policy.switch.samples[key] = deque(switch, maxlen=policy.switch.window)
    policy.accept.restore(counts, first)


def _table(t: dict, policy):
    """(cost key, pairs, jitter, anchor, switch samples) of one table of a state; ValueError
    where a value is out of range."""
    b, kind = t.get("bucket"), t.get("kind")
    if not (_count(b) and b <= 1 << 16 and b & (b - 1) == 0 and kind in COST_KINDS):
        raise ValueError(f"a table's key is not a batch bucket and kind: {b!r}, {kind!r}")
    pairs = {}
    for pair in _list(t, "pairs", list):
        j, k, samples = pair if len(pair) == 3 else (None, None, None)
        if not (_depth(j) and _depth(k) and j < k):
            raise ValueError(f"a cost pair's depths are not two depths in order: {pair!r}")
        pairs[j, k] = _floats(samples, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    anchor = t.get("anchor")
    if not (anchor is None or (_depth(anchor) and 1 <= anchor <= policy.max_depth)):
        raise ValueError(f"a table's anchor is not a drafting depth: {anchor!r}")
    return (b, kind), pairs, _floats(t.get("jitter"), 0.0, MAX_LOG_RATIO), anchor, _floats(t.get("switch"), 0.0, 1e3)


def _counts(c: dict, max_depth: int):
    """((class, depth), (kept, tried)) of one class and depth of a state."""
    k = c.get("depth")
    if not (_depth(k) and 1 <= k <= max_depth):
        raise ValueError(f"acceptance counts of a depth the policy does not draft: {k!r}")
    kept, tried = (_floats(c.get(name), 0.0, 1e9) for name in ("kept", "tried"))
    if not (len(kept) == len(tried) == max_depth + 1 and all(a <= n + 1e-6 for a, n in zip(kept, tried))):
        raise ValueError("acceptance counts of another length, or more kept than tried")
    return (_class_in(c.get("class")), k), (kept, tried)


def _class_out(cls: Hashable):
    return {"opening": cls.kind, "part": cls.part} if isinstance(cls, Opening) else cls


def _class_in(value) -> Hashable:
    if isinstance(value, dict) and value.get("opening") in KINDS and value.get("part") in (0, 1):
        return Opening(value["opening"], value["part"])
    if value in KINDS:
        return value
    raise ValueError(f"not an acceptance class: {value!r}")


def _depth(k) -> bool:
    return isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_CYCLE_DEPTH


def _count(n) -> int:
    if not (isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 62):
        raise ValueError(f"not a count: {n!r}")
    return n


def _list(d: dict, name: str, of: type = dict) -> list:
    value = d.get(name) if isinstance(d, dict) else None
    if not isinstance(value, list) or not all(isinstance(v, of) for v in value):
        raise ValueError(f"'{name}' is not a list of {of.__name__}s")
    return value


def _floats(values, low: float, high: float) -> list:
    if not isinstance(values, list) or len(values) > 1 << 10:
        raise ValueError("not a list of numbers")
    out = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(out) != len(values) or not all(math.isfinite(v) and low <= v <= high for v in out):
        raise ValueError(f"numbers out of [{low}, {high}]")
    return out


class NotKept:
    """Where nothing is kept (`for_engine`): a policy that starts cold and leaves nothing behind."""

    def load_into(self, policy) -> bool:
        return False

    def save(self, policy, now: Optional[float] = None, force: bool = False) -> None:
        pass


def for_engine(model, pieces, config):
    """The file of the policy an engine of `model` (its `pieces`, built from `config`, an
    EngineConfig) decides with (SavedPolicy); NotKept where nothing is kept: no folder set, a
    model not loaded from a folder, no head to draft with, or a pinned depth."""
    model_dir = getattr(model, "model_dir", None)
    if not config.policy_state_dir or model_dir is None or pieces.head is None or config.num_draft is not None:
        return NotKept()
    key = f"{prefix_files.model_fingerprint(Path(model_dir), True, pieces.hidden_state)}; {_machine()}; {_settings(pieces, config)}"
    return SavedPolicy(Path(os.path.expanduser(config.policy_state_dir)), hashlib.sha256(key.encode()).hexdigest()[:20])


def _machine() -> str:
    """The device and machine the costs were measured on, and the code that measured them."""
    info = mx.device_info()
    return (f"mlxmtp {__version__}, policy {FORMAT}; {mx.default_device()} {info.get('device_name')} "
            f"{info.get('architecture')} on {platform.node()}")


def _settings(pieces, config) -> str:
    """The settings that shape a cycle's cost, or where the head drafts."""
    trimmed = getattr(pieces.vocab, "token_ids", None)
    return (f"depth {config.max_depth}; source {config.draft_source}; suffix {config.suffix_drafts}; "
            f"shape-stable {config.shape_stable}; pipelined {config.pipeline_drafts}; compiled {config.compile_steps}; "
            f"profiled {config.profile}; draft vocabulary {None if trimmed is None else len(trimmed)}")


class SavedPolicy:
    """One policy's file: `<folder>/<fingerprint>.json` (`fingerprint`: see the module's doc)."""

    def __init__(self, folder: Path, fingerprint: str):
        self.path = Path(folder) / f"{fingerprint}.json"
        self.fingerprint = fingerprint
        self._saved_at, self._reported = 0.0, None
        self._unwritable = False

    def load_into(self, policy) -> bool:
        """Restore the file's state into `policy` -> whether there was one to restore."""
        try:
            with folders.open_file(self.path) as f:  # a link is not followed
                data = f.read(MAX_BYTES + 1)
        except FileNotFoundError:
            log.info("depth policy: learning afresh; what it learns is kept in %s for the next run", self.path)
            return False
        except OSError as e:
            log.warning("depth policy: cannot read %s (%s); starting cold", self.path, e)
            return False
        try:
            if len(data) > MAX_BYTES:
                raise ValueError(f"over {MAX_BYTES >> 20} MiB, far more than a policy writes")
            restore(policy, self._checked(data.decode()))
        except (ValueError, TypeError, OverflowError, RecursionError) as e:  # decoding and JSON's: ValueErrors
            log.warning("depth policy: ignoring %s (%s); starting cold", self.path, e)
            return False
        self._reported = policy.reported  # nothing new to write yet
        log.info("depth policy: what the last run learnt restored from %s", self.path)
        return True

    def _checked(self, text: str) -> dict:
        doc = prefix_check.unseal(text)  # its checksum, as the prefix cache's index carries one
        if doc.get("format") != FORMAT or doc.get("fingerprint") != self.fingerprint:
            raise ValueError("another format or another model, machine or settings")
        return doc.get("policy")

    def save(self, policy, now: Optional[float] = None, force: bool = False) -> None:
        """Write the policy's state, if it reported a cycle since the last save and SAVE_EVERY
        seconds have passed (`force`: whatever the time). A failure to write costs the next
        run its warm start, never this one: it is logged, not raised."""
        now = time.monotonic() if now is None else now
        if policy.reported == self._reported or (not force and now - self._saved_at < SAVE_EVERY):
            return
        self._saved_at, self._reported = now, policy.reported
        text = prefix_check.seal({"format": FORMAT, "fingerprint": self.fingerprint, "policy": state_of(policy)})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            prefix_files.write_atomically(self.path, lambda tmp: tmp.write_text(text))
        except OSError as e:  # said once: a folder that cannot be written stays so
            (log.debug if self._unwritable else log.warning)("depth policy: cannot write %s (%s)", self.path, e)
            self._unwritable = True
