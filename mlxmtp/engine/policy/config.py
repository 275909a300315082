"""Every knob of the depth policy (adaptive.DepthPolicy), and the reasons it gives for a depth."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PolicyConfig:
    """Every knob of the depth policy, in one place."""

    explore: float = 0.01  # throughput share probes may cost, by the mean estimates
    min_probe_every: int = 20  # cycles between probes, at the least ...
    max_probe_every: int = 2000  # ... and at the most
    window: int = 15  # cost ratios kept per depth pair (cycle_costs)
    margin: float = 0.05  # drafting must beat plain decoding by this much
    hysteresis: float = 0.02  # another drafting depth must beat the current one by this much
    min_samples: int = 3  # cost samples before a depth counts as measured
    learn_drafts: int = 8  # first drafts a class (_learning), a depth (probes.worth_learning) and a request must try
    settled: float = 32.0  # first drafts of a class's own (decayed) past which a request learns only what could pay
    burst: int = 3  # cycles per calibration block / probe without a partner
    prior_accept: float = 0.5  # acceptance assumed before any draft was tried
    prior_weight: float = 2.0  # pseudo-counts of that prior
    depth_weight: float = 4.0  # pseudo-counts shrinking a depth's acceptance to its class's
    request_weight: float = 4.0  # pseudo-counts shrinking a request's first draft to its class's
    decay: float = 0.998  # per-cycle forgetting of acceptance counts
    cost_noise: float = 0.1  # spread of a cycle-cost ratio's log assumed until the machine's noise is measured
    caution: float = 1.0  # standard errors a drafting depth's cost is raised by before it may beat plain decoding
    calibrate: bool = True  # measure cycle costs before the first cycle of a batch bucket
    keep_chances: bool = True  # learn acceptance from sampled drafts' keep chances (sampling/accept.py), not outcomes


# Why a cycle got its depth (DepthPolicy.why, the engine's stats and /metrics).
FIXED, NO_ROOM, CALIBRATING, PROBE, BEST, HOLDING, LEARNING, UNSURE = (
    "fixed", "no room to draft", "calibrating", "probe", "best expected rate", "holding (switch not worth it)",
    "learning acceptance", "drafting not sure to pay")
