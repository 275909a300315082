"""ModelCache's operations on a tiny Qwen3.5 (Gated DeltaNet and attention layers): undoing
a forward (snapshot / restore), rows out of and into a batch (extract_row / extend_rows),
the file layout (to_state / from_state) and a verify's rollback (commit)."""

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import loaded, prompt_of

from mlxmtp.mlxlm import adapter, gdn_capture
from mlxmtp.mlxlm.model_cache import ModelCache


@pytest.fixture(scope="module")
def parts(fixture_model):
    model, _, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    adapter.prepare_model(model.parts.text_model)
    return model.parts


def _run(parts, tokens, cache, record=False):
    """Logits of a forward of `tokens` (rows of token ids), the caches evaluated."""
    with gdn_capture.record() as rec:
        logits, _ = adapter.forward(parts, mx.array(tokens), cache)
    mx.eval(logits, *cache.arrays())
    return (logits, rec.layers) if record else logits


def _row_state(cache: ModelCache, row: int = 0) -> dict:
    """Row `row`'s arrays as the files hold them, by name, and its layout."""
    arrays, meta = cache.extract_row(row).to_state("c")
    return {name: np.array(a) for name, a in arrays.items()}, meta


def _assert_same(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a[1] == b[1] and a[0].keys() == b[0].keys()
    for name in a[0]:
        np.testing.assert_allclose(a[0][name], b[0][name], atol=atol, rtol=atol, err_msg=name)


def test_the_cache_is_the_list_the_forward_takes(parts):
    cache = adapter.make_cache(parts, 1)
    assert isinstance(cache, list) and len(cache.gdn()) and len(cache.attention())
    assert cache.nbytes == 0 and cache.arrays() == []
    _run(parts, [prompt_of(7)], cache)
    per_position, per_row = cache.footprint()
    assert per_position > 0 and per_row > 0 and cache.nbytes == sum(a.nbytes for a in cache.arrays())


@pytest.mark.parametrize("shape_stable", [False, True], ids=["sliced", "shape-stable"])
def test_restore_undoes_a_forward_and_a_deferred_trim(parts, shape_stable):
    cache = adapter.make_cache(parts, 2)
    _run(parts, [prompt_of(8, seed=1), prompt_of(8, seed=2)], cache)
    if shape_stable:
        cache.fix_shapes(2)
    before = [_row_state(cache, b) for b in range(2)]
    snapshot = cache.snapshot()
    step = [prompt_of(3, seed=3), prompt_of(3, seed=4)]
    first = _run(parts, step, cache)
    if shape_stable:
        cache.defer_trim(mx.array([1, 2], dtype=mx.int32))
    cache.restore(snapshot)
    for row, state in enumerate(before):
        _assert_same(_row_state(cache, row), state)
    np.testing.assert_array_equal(np.array(_run(parts, step, cache)), np.array(first))


def test_rows_extracted_and_extended_are_the_rows_they_were(parts):
    short, long = adapter.make_cache(parts, 1), adapter.make_cache(parts, 1)
    _run(parts, [prompt_of(5, seed=5)], short)
    _run(parts, [prompt_of(11, seed=6)], long)
    batch = short.copy()
    batch.extend_rows(long)
    _assert_same(_row_state(batch, 0), _row_state(short))
    _assert_same(_row_state(batch, 1), _row_state(long))
    batch.filter_rows([1])
    _assert_same(_row_state(batch), _row_state(long))
    owned = long.extract_row(0).owned_copy()
    _assert_same(_row_state(owned), _row_state(long))


def test_to_state_and_from_state_round_trip(parts):
    cache = adapter.make_cache(parts, 1)
    prompt = prompt_of(9, seed=7)
    _run(parts, [prompt], cache)
    row = cache.extract_row(0)
    arrays, meta = row.to_state("cache")
    assert all(ModelCache.position_axis(n) == (2 if n.endswith((".keys", ".values")) else None) for n in arrays)
    rebuilt = adapter.make_cache(parts, 1).from_state(meta, "cache", arrays)
    _assert_same(_row_state(rebuilt), _row_state(row))
    nxt = [prompt_of(2, seed=8)]
    np.testing.assert_array_equal(np.array(_run(parts, nxt, rebuilt)), np.array(_run(parts, nxt, cache)))
    swapped = [["gdn", 2] if kind == "kv" else ["kv", 1] for kind, _ in meta]
    with pytest.raises(ValueError, match="layer 0 stored as kv"):
        adapter.make_cache(parts, 1).from_state(swapped, "cache", arrays)
    with pytest.raises(ValueError, match="layers stored"):
        adapter.make_cache(parts, 1).from_state(meta[1:], "cache", arrays)


@pytest.mark.parametrize("kept", [0, 2, 4])
def test_commit_leaves_the_state_after_the_kept_tokens(parts, kept):
    prompt, verified = prompt_of(6, seed=9), prompt_of(4, seed=10)
    cache, plain = adapter.make_cache(parts, 1), adapter.make_cache(parts, 1)
    _run(parts, [prompt], cache)
    _run(parts, [prompt + verified[:kept]], plain)
    _, records = _run(parts, [verified], cache, record=True)
    cache.commit(records, [kept], len(verified))
    _assert_same(_row_state(cache), _row_state(plain), atol=1e-4)


@pytest.mark.parametrize("unread", [False, True], ids=["read", "unread"])
def test_commit_of_a_batch_leaves_each_row_after_its_kept_tokens(parts, unread):
    prompts, verified, kept = [prompt_of(6, seed=11), prompt_of(6, seed=12)], [prompt_of(4, seed=13)] * 2, [1, 3]
    cache = adapter.make_cache(parts, 2)
    _run(parts, prompts, cache)
    if unread:
        cache.fix_shapes(2)  # deferred trims are for shape-stable caches
    _, records = _run(parts, verified, cache, record=True)
    if unread:
        cache.commit_unread(records, mx.array(kept, dtype=mx.int32), 4)
        mx.eval(*cache.arrays())
        cache.settle([4 - n for n in kept])
    else:
        cache.commit(records, kept, 4)
    for b, n in enumerate(kept):
        plain = adapter.make_cache(parts, 1)
        _run(parts, [prompts[b] + verified[b][:n]], plain)
        _assert_same(_row_state(cache, b), _row_state(plain), atol=1e-4)
