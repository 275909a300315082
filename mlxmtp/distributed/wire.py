"""Requests as rank 0 hands them to the other ranks: plain JSON.

Every field of a Request travels, its id included (events and cancellations name it).
A sampled request without a seed gets one from rank 0, so every rank draws the same
numbers. Logits processors are functions; one travels as its recipe, the attribute
`recipe = ("mlxmtp.module:factory", [args])` its factory sets, and is rebuilt by calling
the factory again (only factories inside mlxmtp). A processor without a recipe cannot
run on other machines: such a request is refused with ValueError.
"""

from __future__ import annotations

import dataclasses
import importlib
import secrets
from typing import Callable, List

from ..engine.request import Request
from ..engine.sampling.params import SamplingParams

_PARAMS = [f.name for f in dataclasses.fields(SamplingParams) if f.name != "logits_processors"]


def with_seed(req: Request) -> Request:
    """`req`, seeded when it samples without a seed (rank 0 picks the seed)."""
    if not req.params.greedy and req.params.seed is None:
        req.params.seed = secrets.randbits(63)
    return req


def _recipe(proc: Callable) -> list:
    recipe = getattr(proc, "recipe", None)
    if recipe is None:
        raise ValueError("this request's logits processors cannot run across machines")
    return [recipe[0], list(recipe[1])]


def _rebuild(recipe: list) -> Callable:
    name, args = recipe
    module, _, factory = name.partition(":")
    if not module.startswith("mlxmtp."):
        raise ValueError(f"refusing logits processor factory {name!r} from outside mlxmtp")
    return getattr(importlib.import_module(module), factory)(*args)


def request_to_wire(req: Request) -> dict:
    params = {name: getattr(req.params, name) for name in _PARAMS}
    if params["logit_bias"]:
        params["logit_bias"] = [[int(t), float(v)] for t, v in params["logit_bias"].items()]
    return {"id": req.id, "prompt": list(req.prompt), "max_tokens": req.max_tokens, "stop": list(req.stop),
            "stop_token_ids": req.stop_token_ids, "num_draft": req.num_draft, "logprobs": req.logprobs,
            "shared_prefix": req.shared_prefix,
            "params": params, "processors": [_recipe(p) for p in req.params.logits_processors]}


def request_from_wire(d: dict) -> Request:
    params = dict(d["params"])
    if params["logit_bias"]:
        params["logit_bias"] = {int(t): v for t, v in params["logit_bias"]}
    procs: List[Callable] = [_rebuild(r) for r in d["processors"]]
    return Request(prompt=d["prompt"], max_tokens=d["max_tokens"], params=SamplingParams(**params, logits_processors=procs),
                   stop=d["stop"], stop_token_ids=d["stop_token_ids"], num_draft=d["num_draft"],
                   logprobs=d["logprobs"], shared_prefix=d["shared_prefix"], id=d["id"])
