"""`EngineConfig`: everything an engine is built from, in one frozen object.

The command line makes it once (mlxmtp/commands/), and every engine is built from it: the
engine alone (`BatchGenerator(model, tokenizer, config)`), rank 0 of a distributed server
and every other rank alike, each from the same object; the distributed start-up check
compares it field by field across the ranks (distributed/group.py). A new engine option
is a field here and its use where the engine reads it.

A module without MLX, so the command line can build one before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .limits import MAX_DRAFT_DEPTH, PREFILL_STEP, PREFIX_DISK_MB

DRAFT_SOURCES = ("mtp", "suffix")


@dataclass(frozen=True)
class EngineConfig:
    # Drafting: the MTP head (when the model has one), at a pinned depth or the adaptive
    # policy's (num_draft None) up to max_depth.
    enable_mtp: bool = True
    num_draft: Optional[int] = None
    max_depth: int = MAX_DRAFT_DEPTH
    # What drafts: "mtp", the model's MTP head (enable_mtp); "suffix", the model-free suffix
    # drafter (engine/proposers/suffix.py, any model, the head unused), at a fixed depth
    # (num_draft): the depth policy's calibration times the head's drafts, not its.
    draft_source: str = "mtp"
    # Beside the MTP head, drafts read off the prompt and the output (engine/proposers/
    # hybrid.py), up to limits.MAX_SUFFIX_DEPTH tokens, per row where they promise more; a
    # process alone only (the ranks of a distributed run draft with the head). Off here, on
    # in the commands (`--suffix/--no-suffix`).
    suffix_drafts: bool = False
    # Whether the suffix drafter also drafts from the outputs of requests that finished
    # (never their prompts; a bounded index, proposers/suffix.SHARED_TOKENS), or only from
    # each request's own prompt and output (`--no-suffix-share`).
    suffix_share: bool = True
    # How sampled drafts are kept (engine/sampling/rejection.py): "exact" (rejection
    # sampling); "argmax" is a wrong rule the tests show they catch.
    acceptance_rule: str = "exact"
    # Requests decoded together (more wait), and prompt tokens a prefill chunk takes.
    max_batch: int = 16
    prefill_step: int = PREFILL_STEP
    # The prefix cache: its bytes (0: off; None: the machine's default for the model's
    # weights, engine/budgets.py), the most entries it keeps (None: its bytes alone bound
    # it), and a folder on disk for what it evicts (None: memory only) of at most
    # prefix_cache_disk_mb MiB.
    prefix_cache_bytes: Optional[int] = 0
    prefix_cache_entries: Optional[int] = None
    prefix_cache_dir: Optional[str] = None
    prefix_cache_disk_mb: int = PREFIX_DISK_MB
    # A folder where the adaptive depth policy keeps what it learnt for the next run of the
    # same model and settings on this machine (engine/policy/saved.py; "~" expanded there);
    # None: every run starts cold. Off here, on in the commands (`--policy-state-dir`).
    policy_state_dir: Optional[str] = None
    # What running requests' caches and the prefix cache may hold together (0: unbounded;
    # None: the machine's default, engine/memory.py).
    memory_bytes: Optional[int] = 0
    # How cycles run (engine/pieces.cycle_modes): drafts evaluated on their own to split
    # device time (profile); shape-stable caches (None: on a GPU); pipelined drafting
    # cycles (drafting cycles only with a drafter that can: not "suffix"); the head's and
    # the accept step's compiled graphs.
    profile: bool = False
    shape_stable: Optional[bool] = None
    pipeline_drafts: bool = False
    compile_steps: bool = False

    def validate(self) -> None:
        """Raise ValueError for settings no engine runs (checked where an engine is built:
        the ranks' agreement hashes configs of any value)."""
        if self.draft_source not in DRAFT_SOURCES:
            raise ValueError(f"draft_source must be one of {DRAFT_SOURCES}, got {self.draft_source!r}")
        if self.draft_source == "suffix" and self.num_draft is None:
            raise ValueError('draft_source="suffix" needs a fixed depth (num_draft): the adaptive '
                             "policy's calibration measures the MTP head's drafts")
