"""Single-request generation: a batch of one on the same engine the server runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional

from .build import build_engine
from .config import EngineConfig
from .interface import Engine
from .request import Event, Request, RequestStats
from .sampling.params import SamplingParams


@dataclass
class GenerationResult:
    text: str
    token_ids: List[int]
    finish_reason: Optional[str]
    stats: RequestStats
    prompt_tokens: int


def stream_generate(model, tokenizer, prompt: List[int], *, max_tokens: int = 256,
                    params: Optional[SamplingParams] = None, stop: Optional[List[str]] = None,
                    config: EngineConfig = EngineConfig(),
                    engine: Optional[Engine] = None) -> Iterator[Event]:
    """The request's events, on `engine`, or on one built from `config`."""
    engine = engine or build_engine(model, tokenizer, config)
    req = Request(prompt=list(prompt), max_tokens=max_tokens, params=params or SamplingParams(),
                  stop=list(stop or []))
    engine.submit(req)
    while True:
        for ev in engine.step():
            if ev.request_id == req.id:
                yield ev
                if ev.finish_reason is not None:
                    return


def generate(model, tokenizer, prompt: List[int], **kwargs) -> GenerationResult:
    text, ids, ev = [], [], None
    for ev in stream_generate(model, tokenizer, prompt, **kwargs):
        text.append(ev.text)
        ids.extend(ev.token_ids)
    return GenerationResult("".join(text), ids, ev.finish_reason, ev.stats, len(prompt))
