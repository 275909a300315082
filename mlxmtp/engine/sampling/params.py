"""A request's sampling fields and their ranges: the one place the range rules live.

The engine refuses what it cannot run (`SamplingParams.validate`); the server's APIs and
the command line check the same ranges (`RANGES`) at their edge, each in its own error
format, narrowed where an API documents a narrower one (OpenAI's temperature 0-2).
Plain Python, without MLX: the command line reads the ranges at start-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional

GREEDY_BELOW = 1e-5  # temperatures and top_p below it decode greedily (SamplingParams.__post_init__)
SEED_LIMIT = 2**64


@dataclass(frozen=True)
class Range:
    """A field's allowed values: low .. high (None: unbounded), each end open or closed."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def text(self) -> str:
        """'>= 0', '> 0' or 'in (0, 1]', as the engine's messages say it."""
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        high = "2**64" if self.high == SEED_LIMIT else f"{self.high:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {high}{')' if self.high_open else ']'}"


# The engine's range of each bounded field; the vocabulary bounds top_k and logit_bias's
# token ids besides (`validate`). Floats where the field is a float: the server's
# messages print the bounds as given.
RANGES = {
    "temperature": Range(0.0),
    "top_p": Range(0.0, 1.0, low_open=True),
    "top_k": Range(0),
    "min_p": Range(0.0, 1.0),
    "repetition_penalty": Range(0.0, low_open=True),
    "seed": Range(0, SEED_LIMIT, high_open=True),
}


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None
    seed: Optional[int] = None
    # With a seed: decide every token by (seed, position) alone, so the output does not
    # depend on the draft depth (sampling/seeded.py). The server and `generate` set it for
    # every seeded request; off, a seed only makes the engine's draws repeatable.
    reproducible: bool = False
    logits_processors: List[Callable] = field(default_factory=list)

    def __post_init__(self):
        # A temperature or top_p this small leaves one token its probability, and float32
        # cannot compute it (1 / temperature overflows to inf, 1 - top_p rounds to 1: every
        # token masked): such a request decodes greedily, as vLLM's do below 1e-5.
        if 0 < self.temperature < GREEDY_BELOW or 0 < self.top_p < GREEDY_BELOW:
            self.temperature = 0.0

    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Raise ValueError, its message starting with the field's name, for what the engine cannot run."""
        numbers = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
                   "repetition_penalty": self.repetition_penalty, "presence_penalty": self.presence_penalty,
                   "frequency_penalty": self.frequency_penalty}
        numbers.update({f"logit_bias[{t}]": v for t, v in (self.logit_bias or {}).items()})
        for name, value in numbers.items():
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number")
        for name, rule in RANGES.items():
            value = getattr(self, name)
            if value is not None and not rule.holds(value):
                raise ValueError(f"{name} must be {rule.text()}")
        if vocab_size is not None and self.top_k >= vocab_size:
            raise ValueError(f"top_k must be < the vocabulary size ({vocab_size})")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in (self.logit_bias or {})):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
