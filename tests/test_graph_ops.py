"""What a decode step launches on a GPU, counted exactly (mlxmtp/testing/graph_ops.py).

On a GPU each operation MLX evaluates is a kernel launch, which a small model's decode
step pays in host and launch time. Counted on any backend, the operations check
the kernel side of three of the GPU targets without a GPU and without timing noise:
- plain decoding (MTP off) evaluates no more operations per token than mlx-lm's own
  decoding, for every family;
- an engine with the head, held at plain decoding (where the depth policy settles when
  drafting does not pay), evaluates exactly what MTP off does: the head costs nothing
  until it drafts;
- the verify forward of T tokens, with its recording for rollback and the acceptance,
  evaluates no more than mlx-lm's own T-token forward plus a few operations.
"""

import mlx.core as mx
import pytest
from engine_helpers import loaded, prompt_of
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.generate import stream_generate
from mlxmtp.engine.policy.base import Policy
from mlxmtp.engine.sampling import rejection
from mlxmtp.mlxlm import adapter, gdn_capture
from mlxmtp.testing.fixtures import FAMILIES
from mlxmtp.testing.graph_ops import OpCounter

TOKENS = 24  # decode steps counted, after the first token


class HoldPlain(Policy):
    """A depth policy that stays at plain decoding, as the adaptive one does where
    drafting does not pay."""

    max_depth = 4
    why = "held at plain decoding"

    def choose(self, batch_size, limit=None, classes=None, requests=None):
        return 0

    def plain_regime(self):
        return True


def mlx_lm_ops_per_token(ref, prompt):
    """Operations mlx-lm's own greedy decoding evaluates per token, after the first."""
    with OpCounter() as ops:
        for i, _ in enumerate(generate_step(mx.array(prompt), ref, max_tokens=TOKENS + 1)):
            if i == 0:
                ops.reset()
    return ops.kernels / TOKENS


def engine_ops_per_token(engine, model, tok, prompt):
    """Operations the engine evaluates per token for one greedy request, after the first."""
    got = 0
    with OpCounter() as ops:
        for i, ev in enumerate(stream_generate(model, tok, prompt, max_tokens=TOKENS + 1, engine=engine)):
            if i == 0:
                ops.reset()
            else:
                got += len(ev.token_ids)
    assert got == TOKENS
    return ops.kernels / TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_plain_decoding_evaluates_no_more_than_mlx_lm(fixture_model, family):
    model, tok, ref = loaded(str(fixture_model(family)["hf"]))
    prompt = prompt_of(20, seed=3)
    theirs = mlx_lm_ops_per_token(ref, prompt)
    off = engine_ops_per_token(BatchGenerator(model, tok, EngineConfig(enable_mtp=False)), model, tok, prompt)
    assert 0 < off <= theirs, (off, theirs)
    held = BatchGenerator(model, tok, EngineConfig(enable_mtp=True))
    held.policy = HoldPlain()
    with_head = engine_ops_per_token(held, model, tok, prompt)
    assert with_head == off, (with_head, off)


def test_the_counter_sees_every_evaluation():
    # Each entry point counts the graph it evaluates once; evaluated arrays are leaves.
    x = mx.ones((3, 3))
    mx.eval(x)
    with OpCounter() as ops:
        y = mx.exp(x)
        mx.async_eval(y)
        mx.eval(y * 2)
        assert (y + 1).sum().item() > 0
        assert int(mx.argmax(y[0])) == 0
        assert (y - 1).tolist()[0][0] > 0
    assert ops.by_primitive["Exp"] == 1 and ops.by_primitive["Multiply"] == 1
    assert ops.by_primitive["Sum"] == 1 and ops.by_primitive["ArgReduce"] == 1
    assert ops.by_primitive["Subtract"] == 1
    assert mx.eval.__name__ == "eval" and mx.array.item.__name__ == "item"  # restored


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_6_moe"])
@pytest.mark.parametrize("shape_stable", [False, True], ids=["sliced", "shape-stable"])
def test_verify_evaluates_what_mlx_lm_forward_does(fixture_model, family, shape_stable):
    model, _, ref = loaded(str(fixture_model(family)["hf"]))
    prompt = mx.array([prompt_of(40, seed=5)])
    theirs_cache = make_prompt_cache(ref)
    mx.eval(ref(prompt, cache=theirs_cache))
    cache = adapter.make_cache(model.parts, 1)
    mx.eval(adapter.forward(model.parts, prompt, cache)[0])
    if shape_stable:
        cache.fix_shapes(2)
    for T in range(2, 6):
        tokens = mx.array([prompt_of(T, seed=T)])
        with OpCounter() as ops:
            mx.eval(ref(tokens, cache=theirs_cache), [c.state for c in theirs_cache])
        theirs = ops.kernels
        with OpCounter() as ops, gdn_capture.record():
            logits, _ = adapter.forward(model.parts, tokens, cache)
            kept, picked = rejection.rules("exact", False)[0](logits, tokens[:, 1:])
            mx.eval(kept, picked, *cache.arrays())
        # The acceptance (argmax, compare, count) and the masked write of shape-stable
        # caches add a handful of operations to a forward of several hundred.
        assert ops.kernels <= theirs + 10, (T, ops.kernels, theirs)
        for c in theirs_cache:
            if c.is_trimmable():
                c.trim(T)
        cache.trim_rows([T])


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 3])
def test_a_thinking_budget_far_from_reached_costs_nothing(fixture_model, k):
    # Every Claude Code request carries a thinking budget: a processor that leaves logits
    # untouched until the budget is near. Till then the row takes the paths of a row with
    # no processor (vectorised, pipelined), with the same tokens and the same operations.
    from mlxmtp.engine.generate import stream_generate
    from mlxmtp.engine.sampling.params import SamplingParams
    from mlxmtp.server.thinking_budget import budget_processor

    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    prompt = prompt_of(20, seed=3)
    runs = []
    for procs in ([], [budget_processor(len(prompt), 500, 1, 2, starts_inside=True)]):
        engine = BatchGenerator(model, tok, EngineConfig(num_draft=k))
        got = []
        with OpCounter() as ops:
            for ev in stream_generate(model, tok, prompt, max_tokens=TOKENS, engine=engine,
                                      params=SamplingParams(logits_processors=procs)):
                got += ev.token_ids
        runs.append((got, ops.kernels))
    assert runs[0] == runs[1]
