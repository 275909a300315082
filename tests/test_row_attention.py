"""Rows of very different lengths attend per group (mlxlm/row_attention.py): each group reads
its own extent of the batch's KV buffers, and every row's output stays exactly mlx-lm's."""

import mlx.core as mx
import pytest
from engine_helpers import loaded, prompt_of, reference_greedy
from test_batching import run_schedule

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.request import Request
from mlxmtp.mlxlm import row_attention
from mlxmtp.mlxlm.ragged_cache import RaggedKVCache


def test_rows_of_similar_lengths_attend_in_one_call():
    assert row_attention.plan_groups((300, 500, 280, 410), call_cost=1024) is None
    assert row_attention.plan_groups((5000,), call_cost=0) is None
    # Saving exactly one call's cost is not worth the call.
    assert row_attention.plan_groups((1124, 100), call_cost=1024) is None
    assert row_attention.plan_groups((1125, 100), call_cost=1024) == ((0, 1, 1125), (1, 2, 100))


def test_a_long_row_gets_its_own_call_and_neighbours_of_one_size_share_one():
    assert row_attention.plan_groups((16000, 300, 300, 300), call_cost=1024) == ((0, 1, 16000), (1, 4, 300))
    assert row_attention.plan_groups((300, 16000, 200, 300), call_cost=1024) == (
        (0, 1, 300), (1, 2, 16000), (2, 4, 300))
    # Two long rows side by side share their call; the short ones share theirs.
    assert row_attention.plan_groups((9000, 9500, 300, 250), call_cost=1024) == ((0, 2, 9500), (2, 4, 300))
    # A short row between two long ones is not worth two more calls when they are cheap to pad.
    assert row_attention.plan_groups((9000, 8500, 9500), call_cost=1024) is None


def _cache(lengths, capacity, fixed=False):
    c = RaggedKVCache(len(lengths))
    c.keys = mx.random.normal((len(lengths), 2, capacity, 8))
    c.values = mx.random.normal((len(lengths), 2, capacity, 8))
    c.lengths = list(lengths)
    c.fixed_shape_from = 2 if fixed else None
    return c


def _spy(monkeypatch):
    calls = []
    inner = row_attention._mlx_lm_attention

    def spy(q, k, v, cache, scale, mask, sinks=None):
        calls.append((q.shape[0], k.shape[2], mask if mask is None or isinstance(mask, str) else mask.shape))
        return inner(q, k, v, cache=cache, scale=scale, mask=mask, sinks=sinks)

    monkeypatch.setattr(row_attention, "_mlx_lm_attention", spy)
    return calls


@pytest.mark.parametrize("T", [1, 3])
def test_each_group_reads_its_own_extent_and_gets_what_the_padded_call_gives(monkeypatch, T):
    calls = _spy(monkeypatch)
    monkeypatch.setattr(row_attention, "CALL_COST_POSITIONS", 64)
    c = _cache([700, 20, 20], 1024)
    q, (k, v) = mx.random.normal((3, 4, T, 8)), (mx.random.normal((3, 2, T, 8)) for _ in range(2))
    mask = c.make_mask(T)
    keys, values = c.update_and_fetch(k, v)
    assert c.attention_groups == ((0, 1, 700 + T), (1, 3, 20 + T))
    got = row_attention.attention(q, keys, values, c, 0.35, mask)
    # Each group alone and sliced to its length: no mask for one token, causal for several.
    lone = None if T == 1 else "causal"
    assert calls == [(1, 700 + T, lone), (2, 20 + T, lone)]
    c.attention_groups = None  # the same forward as one padded, masked call
    want = row_attention.attention(q, keys[..., : 700 + T, :], values[..., : 700 + T, :], c, 0.35, mask)
    assert mx.allclose(got, want, atol=1e-5).item()


def test_shape_stable_groups_read_capacity_buckets_under_their_part_of_the_mask(monkeypatch):
    calls = _spy(monkeypatch)
    monkeypatch.setattr(row_attention, "CALL_COST_POSITIONS", 64)
    c = _cache([20, 700, 30], 1024, fixed=True)
    q, (k, v) = mx.random.normal((3, 4, 4, 8)), (mx.random.normal((3, 2, 4, 8)) for _ in range(2))
    mask = c.make_mask(4)
    keys, values = c.update_and_fetch(k, v)
    assert c.attention_groups == ((0, 1, 256), (1, 2, 768), (2, 3, 256))
    got = row_attention.attention(q, keys, values, c, 0.35, mask)
    assert calls == [(1, 256, (1, 1, 4, 256)), (1, 768, (1, 1, 4, 768)), (1, 256, (1, 1, 4, 256))]
    c.attention_groups = None
    want = row_attention.attention(q, keys, values, c, 0.35, mask)
    assert mx.allclose(got, want, atol=1e-5).item()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("mtp,shape_stable,pipelined", [(False, False, False), (True, False, False),
                                                        (True, True, False), (True, True, True)])
def test_a_batch_split_by_lengths_equals_mlx_lm_row_by_row(monkeypatch, fixture_model, family, mtp, shape_stable,
                                                          pipelined):
    """A long row beside short ones (a call costs 16 positions here, so they split): every
    row's greedy output is mlx-lm's, with MTP off, on, in shape-stable cycles and in pipelined
    ones (row lengths then upper bounds), and the split really happened."""
    monkeypatch.setattr(row_attention, "CALL_COST_POSITIONS", 16)
    calls = _spy(monkeypatch)
    model, tok, ref = loaded(str(fixture_model(family)["hf"]))
    reqs = [Request(prompt=prompt_of(n, seed=i), max_tokens=24) for i, n in enumerate([5, 300, 12, 9])]
    expected = {r.id: reference_greedy(ref, r.prompt, r.max_tokens) for r in reqs}
    eng = BatchGenerator(model, tok, EngineConfig(enable_mtp=mtp, num_draft=2 if mtp else None, prefill_step=128,
                                                  shape_stable=shape_stable, pipeline_drafts=pipelined))
    outs, _ = run_schedule(eng, [(0, r) for r in reqs], hook_expected=expected if mtp else None)
    assert all(outs[r] == w for r, w in expected.items())
    assert any(rows < 4 for rows, _, _ in calls), "no forward attended by groups"
