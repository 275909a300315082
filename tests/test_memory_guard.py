"""The memory guard (engine/memory.py): running rows and the prefix cache stay within a
byte budget. A prompt waits until the batch it joins fits; a batch that outgrows the
budget sends its newest row back to wait, and that row resumes where it was: every
output still equals mlx-lm's own greedy output. Checked against the bytes the caches
really hold, at every step."""

import pytest
from engine_helpers import loaded, oracle_hook, prompt_of, reference_greedy
from server_helpers import served_engine

from mlxmtp.engine import memory
from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.pieces import model_pieces
from mlxmtp.engine.prefix.cache import PrefixCache
from mlxmtp.engine.request import Request
from mlxmtp.mlxlm import row_attention
from mlxmtp.mlxlm.ragged_cache import RaggedKVCache


def held_bytes(eng) -> int:
    """What the engine's caches hold now: the batch, rows mid-prefill, the prefix cache."""
    caches = [eng.cache, eng.head_cache] + [c for r in eng.waiting for c in (r.cache, r.head_cache)]
    return sum(c.nbytes for c in caches if c) + eng.prefix_cache.bytes


def run(eng, requests, expected=None):
    """Submit all at once, step to the end -> ({id: tokens}, [(step, id, what)] with what in
    'first' (its first token) and 'finish'), checking the held bytes at every step."""
    for req in requests:
        eng.submit(req)
    if expected is not None:
        eng.draft_hook = oracle_hook(expected, p_correct=0.7, seed=3)
    outs, log, step = {}, [], 0
    while eng.has_work:
        for ev in eng.step():
            if ev.token_ids and ev.request_id not in outs:
                log.append((step, ev.request_id, "first"))
            outs.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finish_reason:
                log.append((step, ev.request_id, "finish"))
                assert ev.finish_reason == "length"
        if eng.memory.enabled:
            assert held_bytes(eng) <= eng.memory.budget, step
        step += 1
    return outs, log


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_the_footprint_is_what_a_decoding_row_holds(fixture_model, family):
    model, tok, _ = loaded(str(fixture_model(family)["hf"]))
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=2))
    eng.submit(Request(prompt=prompt_of(300, seed=1), max_tokens=40))
    while not eng.rows:
        eng.step()
    eng.step()
    per_position = per_row = 0
    for c in eng.cache + eng.head_cache:
        if isinstance(c, RaggedKVCache):
            per_position += (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2]
        else:
            per_row += sum(a.nbytes for a in c.cache if a is not None)
    footprint = memory.measure(eng.pieces)
    assert footprint == memory.Footprint(per_position, per_row)
    assert per_position > 0 and per_row > 0
    assert memory.measure(model_pieces(model, False)).per_position < per_position  # the head's KV counts


def _budget_for(model, rows: int, positions: int, mtp: bool = True) -> int:
    return memory.measure(model_pieces(model, mtp)).bytes(rows, positions)


def test_a_prompt_waits_until_the_batch_it_joins_fits(fixture_model):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    reqs = [Request(prompt=prompt_of(40, seed=11), max_tokens=30), Request(prompt=prompt_of(45, seed=12), max_tokens=30)]
    expected = {r.id: reference_greedy(ref, r.prompt, 30) for r in reqs}
    budget = _budget_for(model, 1, 45 + 1 + 4 + memory.ADMIT_HEADROOM)  # room for one row
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=3, memory_bytes=budget))
    outs, log = run(eng, reqs, expected)
    assert outs == expected
    assert eng.memory.running == 0  # what /metrics reads once the server is idle again
    a, b = reqs
    assert log.index(next(e for e in log if e[1:] == (a.id, "finish"))) < \
        log.index(next(e for e in log if e[1:] == (b.id, "first")))  # b started after a left
    with_room = BatchGenerator(model, tok, EngineConfig(num_draft=3, memory_bytes=2 * budget))
    assert run(with_room, [Request(prompt=r.prompt, max_tokens=30) for r in reqs])[1][1][2] == "first"  # together


def test_running_rows_take_memory_back_from_the_prefix_cache(fixture_model):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    budget = _budget_for(model, 1, 45 + 1 + 4 + memory.ADMIT_HEADROOM)
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=3, memory_bytes=budget, prefix_cache_bytes=1 << 30))
    a = Request(prompt=prompt_of(40, seed=11), max_tokens=30)
    run(eng, [a])
    kept = eng.prefix_cache.bytes
    assert kept > 0  # a's state, stored as it left
    b = Request(prompt=prompt_of(45, seed=12), max_tokens=30)
    outs, _ = run(eng, [b])  # held bytes, the prefix cache's included, stay within the budget
    assert outs[b.id] == reference_greedy(ref, b.prompt, 30)
    assert not [key for key in eng.prefix_cache.entries if key[:40] == tuple(a.prompt)]  # a's gave way


@pytest.mark.slow
@pytest.mark.parametrize("mode,split", [("plain", False), ("mtp", False), ("pipelined", False), ("adaptive", False),
                                        ("plain", True), ("mtp", True)])
def test_a_batch_that_outgrows_its_budget_sends_its_newest_row_back(fixture_model, monkeypatch, mode, split):
    """Two rows fit at first; once they grow past a buffer step only one does: the newer
    one waits, resumes by prefilling its tokens so far when the other has finished, and
    both outputs equal mlx-lm's. `split`: the two rows, of different lengths, attend apart
    (row_attention with no cost for a call) while they run together (sliced caches: in
    shape-stable ones rows in one capacity bucket never split)."""
    monkeypatch.setattr(memory, "ADMIT_HEADROOM", 0)
    grouped = []  # the groups planned for each attention call
    if split:
        monkeypatch.setattr(row_attention, "CALL_COST_POSITIONS", 0)
        inner = row_attention._mlx_lm_attention
        monkeypatch.setattr(row_attention, "_mlx_lm_attention",
                            lambda *a, **kw: grouped.append(getattr(kw["cache"], "attention_groups", None))
                            or inner(*a, **kw))
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    n = 300
    reqs = [Request(prompt=prompt_of(20, seed=21), max_tokens=n), Request(prompt=prompt_of(24, seed=22), max_tokens=n)]
    expected = {r.id: reference_greedy(ref, r.prompt, n) for r in reqs}
    step = RaggedKVCache.step
    options = {"plain": dict(enable_mtp=False), "mtp": dict(num_draft=3), "adaptive": {},
               "pipelined": dict(num_draft=2, pipeline_drafts=True)}[mode]
    budget = _budget_for(model, 2, step, mtp=mode != "plain")
    eng = BatchGenerator(model, tok, EngineConfig(memory_bytes=budget, prefill_step=64, **options))
    outs, log = run(eng, reqs, expected if mode in ("mtp", "pipelined") else None)
    assert outs == expected
    first, second = reqs
    assert eng.memory.preempted == 1
    finished = [i for _, i, w in log if w == "finish"]
    assert finished == [first.id, second.id]  # the older row went on; the newer waited
    assert eng.cache is None and not eng.waiting
    assert not split or any(g is not None for g in grouped)


@pytest.mark.slow
def test_a_lone_row_starts_and_is_never_sent_back(fixture_model):
    """With nothing else running a row starts and goes on even past the budget (the
    server's context length keeps it within)."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    req = Request(prompt=prompt_of(20, seed=31), max_tokens=300)
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=2, memory_bytes=_budget_for(model, 1, RaggedKVCache.step)))
    eng.submit(req)
    outs = []
    while eng.has_work:
        for ev in eng.step():
            outs.extend(ev.token_ids)
    assert outs == reference_greedy(ref, req.prompt, 300)
    assert eng.memory.preempted == 0


def test_a_budget_caps_what_one_row_can_reach():
    fp = memory.Footprint(per_position=1000, per_row=5000, step=256)
    assert fp.bytes(2, 300) == 2 * (512 * 1000 + 5000)
    assert fp.max_positions(5000 + 256 * 1000 * 3 + 999) == 768
    assert fp.max_positions(100) == 0
    assert memory.MemoryGuard(fp, memory.Room(0), PrefixCache(0)).max_positions() > 1 << 40  # unbounded


def test_the_server_caps_the_context_at_what_memory_holds(start_server, server_model):
    import anthropic
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    model, tok = server_model
    cap = memory.measure(model_pieces(model, True)).max_positions(1 << 20)
    assert 0 < cap < 4096  # below the fixture's own context
    srv = start_server(engine=served_engine(memory_bytes=1 << 20))
    assert srv.app.state.server.context_length == cap
    client = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "word " * cap}])
    assert f"tokens > {cap - 1} maximum" in str(e.value)  # Claude Code compacts on it
    ok = client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "word " * 20}])
    assert ok.usage.output_tokens == 4
    samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
               for s in f.samples}
    assert samples["mlxmtp_memory_budget_bytes"] == 1 << 20
    assert samples["mlxmtp_memory_preempted_requests"] == 0


def test_rows_left_behind_give_back_the_capacity_of_a_longer_one():
    """A batch's buffers are cut to what the rows kept need when a longer row leaves (as a
    batch it runs with), and the kept rows' keys and values stay as they were."""
    import mlx.core as mx

    c = RaggedKVCache(3)
    k = mx.random.normal((3, 2, 700, 8))
    c.update_and_fetch(k, k + 1)
    c.lengths = [700, 30, 260]
    c.filter([1, 2])
    assert c.keys.shape == (2, 2, 2 * RaggedKVCache.step, 8) and c.lengths == [30, 260]
    assert mx.array_equal(c.keys[0, :, :30], k[1, :, :30]) and mx.array_equal(c.values[1, :, :260], k[2, :, :260] + 1)
    c.filter([0])
    assert c.keys.shape[2] == RaggedKVCache.step and mx.array_equal(c.keys[0, :, :30], k[1, :, :30])


@pytest.mark.slow
@pytest.mark.parametrize("shape_stable", [False, True], ids=["sliced", "shape-stable"])
def test_a_long_row_that_leaves_takes_its_capacity_with_it(fixture_model, monkeypatch, shape_stable):
    """A long prompt and a short one run together; once the long one has finished, two more
    short ones join. The budget holds two rows at the long capacity: three short rows fit
    it only if the rows left behind no longer hold (or attend over) the long row's buffer."""
    monkeypatch.setattr(memory, "ADMIT_HEADROOM", 0)
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    long = Request(prompt=prompt_of(600, seed=31), max_tokens=4)
    shorts = [Request(prompt=prompt_of(20 + i, seed=32 + i), max_tokens=60) for i in range(3)]
    budget = _budget_for(model, 2, 600 + 1 + 4)
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=2, memory_bytes=budget, shape_stable=shape_stable))
    eng.submit(long)
    eng.submit(shorts[0])
    outs, later = {}, list(shorts[1:])
    while eng.has_work:
        for ev in eng.step():
            outs.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.request_id == long.id and ev.finish_reason:
                for req in later:
                    eng.submit(req)
        assert held_bytes(eng) <= eng.memory.budget
        if long.id in outs and eng.rows and all(r.req.id != long.id for r in eng.rows):
            for c in eng.cache + eng.head_cache:
                if isinstance(c, RaggedKVCache):
                    assert c.keys.shape[2] == RaggedKVCache.step
    assert eng.memory.preempted == 0
    for req in [long, *shorts]:
        assert outs[req.id] == reference_greedy(ref, req.prompt, req.max_tokens)
