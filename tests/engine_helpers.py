"""Shared helpers for the engine tests: mlx-lm references, forced-draft hooks and a stand-in
for the Hugging Face Hub."""

from __future__ import annotations

import fnmatch
import random
import shutil
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step

from mlxmtp.models.load import load


@lru_cache(maxsize=None)
def loaded(path: str):
    """(mlxmtp model with head, tokenizer, stock mlx-lm model) for a fixture folder."""
    model, tok = load(path)
    ref, _ = mlx_lm.load(path)
    return model, tok, ref


@contextmanager
def own_policies(model):
    """Engines of `model` built inside get depth policies of their own: engines of a model share
    them (engine/pieces.shared_policy), `loaded` keeps models for the session, and a test that
    asks what a fresh server does, or changes a policy's settings, must neither see nor leave
    what other tests taught one."""
    saved = dict(model.policies)
    model.policies.clear()
    try:
        yield
    finally:
        model.policies.clear()
        model.policies.update(saved)


# (id of the model, prompt, n) -> (the model, its output): many tests decode the same
# prompts with the same fixture models (`loaded` keeps them for the session); the model is
# held in the value so that its id cannot be reused by another.
_REFERENCE_OUTPUTS = {}


def reference_greedy(ref_model, prompt, n):
    """mlx-lm's own greedy decoding: the ground truth every MTP setting must match
    (computed once per model, prompt and length)."""
    key = (id(ref_model), tuple(prompt), n)
    if key not in _REFERENCE_OUTPUTS:
        out = []
        for tok, _ in generate_step(mx.array(prompt), ref_model, max_tokens=n):
            out.append(int(tok))
            if len(out) == n:
                break
        _REFERENCE_OUTPUTS[key] = (ref_model, out)
    return list(_REFERENCE_OUTPUTS[key][1])


def asked_again(tok, ref_model, n):
    """The demo asked again: a code prompt, the model's own greedy answer (n tokens) and the
    prompt once more, text the model mostly re-writes (what suffix drafts are for)."""
    prompt = tok.encode("import os\nimport sys\n\n\ndef main(argv):\n    ")
    return prompt + reference_greedy(ref_model, prompt, n) + prompt


def prompt_of(length: int, seed: int = 0, vocab: int = 290):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def oracle_hook(expected: dict, p_correct: float = 0.7, seed: int = 0):
    """Replace drafts by the known continuation, each corrupted with prob 1 - p_correct,
    so every acceptance length 0..k occurs. expected: request id -> full greedy output.

    `unread` (a drafting cycle built on one not read yet): [B] tokens each row emits in
    that cycle beyond row.generated, on the device; the drafts are then gathered there."""
    rng = random.Random(seed)

    def hook(rows, drafts, unread=None):
        k = drafts.shape[1]
        out = []
        for b, row in enumerate(rows):
            if row.req.id not in expected:  # e.g. sampled rows keep their own drafts
                out.append(drafts[b])
                continue
            ref = mx.array(expected[row.req.id] + [0] * (k + 8), dtype=mx.int32)
            g = mx.array(row.generated)  # tokens emitted so far; the next one is ref[g]
            if unread is not None:
                g = g + unread[b]
            d = mx.minimum(g + mx.arange(k), len(expected[row.req.id]) + k)
            d = mx.where(g + mx.arange(k) < len(expected[row.req.id]), ref[d], 0)
            shift = [1 + rng.randrange(50) if rng.random() > p_correct else 0 for _ in range(k)]
            out.append(mx.where(mx.array(shift) > 0, (d + mx.array(shift)) % 290, d))
        return mx.stack(out).astype(mx.int32)

    return hook


def calibration_calls(monkeypatch, kinds: Optional[list] = None) -> list:
    """The batch sizes the engine calibrates cycle costs at, recorded as it goes (and in
    `kinds`, where given, the kinds of batches each call measured)."""
    from mlxmtp.engine.policy import calibration
    from mlxmtp.engine.policy.base import COST_KINDS

    calls = []
    measure = calibration.measure_cycle_costs

    def spy(pieces, batch_size, *args, **kwargs):
        calls.append(batch_size)
        if kinds is not None:
            kinds.append(tuple(kwargs.get("kinds", COST_KINDS)))
        return measure(pieces, batch_size, *args, **kwargs)

    monkeypatch.setattr(calibration, "measure_cycle_costs", spy)
    return calls


def hub_from_folder(monkeypatch, source: Path, cache: Path, repo_id: str) -> None:
    """models.hub fetches `repo_id` from a copy of the local folder `source` into `cache`,
    file by file as huggingface_hub's snapshot_download does by its allow_patterns."""
    from mlxmtp.models import hub

    def fake_snapshot_download(repo, revision=None, allow_patterns=()):
        assert repo == repo_id
        for f in source.rglob("*"):
            rel = str(f.relative_to(source))
            if f.is_file() and any(fnmatch.fnmatch(rel, p) for p in allow_patterns):
                (cache / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(f, cache / rel)
        return str(cache)

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot_download)


def suffix_drafted_after(model, tok, prompts, processors, max_tokens: int, k: int = 8):
    """Greedy requests for `prompts`, one after another, on one engine drafting with the
    suffix drafter alone at depth k, each held by `processors(prompt)` (a fresh list of
    logits processors): the later requests draft from the earlier ones' outputs in the
    shared index -> (tokens, stats) of each."""
    from mlxmtp.engine.batch import BatchGenerator
    from mlxmtp.engine.config import EngineConfig
    from mlxmtp.engine.request import Request
    from mlxmtp.engine.sampling.params import SamplingParams

    eng = BatchGenerator(model, tok, EngineConfig(num_draft=k, draft_source="suffix"))
    out = []
    for p in prompts:
        eng.submit(Request(prompt=p, max_tokens=max_tokens, params=SamplingParams(logits_processors=processors(p))))
        got, stats = [], None
        while eng.has_work:
            for ev in eng.step():
                got += ev.token_ids
                stats = ev.stats or stats
        out.append((got, stats))
    return out
