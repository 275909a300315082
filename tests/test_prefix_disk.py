"""The prefix cache's disk tier (engine/prefix_disk.py): entries evicted from memory, and
those held when the engine stops, are written to a folder and loaded back for prompts that
start with them, also by a new engine (a restarted server), giving the output a fresh
prefill gives (mlx-lm's own). Files of another model, broken or half-written ones are never
restored; the folder stays within its budget."""

import functools
import json

import httpx
import pytest
from engine_helpers import loaded, prompt_of, reference_greedy
from server_helpers import load_bench_module

from mlxmtp.engine import prefix_disk
from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.request import Request
from mlxmtp.testing.fixtures import write_hf_checkpoint


def run(eng, prompts, max_tokens=12):
    """Serve `prompts` one after another -> ([tokens], [cached prompt tokens])."""
    outs, cached = [], []
    for prompt in prompts:
        eng.submit(Request(prompt=prompt, max_tokens=max_tokens))
        out, last = [], None
        while eng.has_work:
            for ev in eng.step():
                out, last = out + ev.token_ids, ev
        outs.append(out)
        cached.append(last.stats.cached_prompt_tokens)
    return outs, cached


def engine(model, tok, folder, mtp=True, memory=256 << 20, disk=256 << 20):
    eng = BatchGenerator(model, tok, enable_mtp=mtp, num_draft=2 if mtp else None, prefix_cache_bytes=memory,
                         prefill_step=64)
    prefix_disk.attach(eng, folder, disk)
    return eng


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("mtp", [True, False])
def test_a_new_engine_continues_from_the_states_the_last_one_saved(fixture_model, tmp_path, family, mtp):
    model, tok, ref = loaded(str(fixture_model(family)["hf"]))
    system = prompt_of(150, seed=1)
    first, other = system + prompt_of(6, seed=2), system + prompt_of(8, seed=6)
    eng = engine(model, tok, tmp_path, mtp)
    (out1, _), _ = run(eng, [first, other])  # the second stores the state after `system` (a branch point)
    held = set(eng.prefix_cache.entries)
    eng.prefix_cache.save_to_disk()  # what the server does when it stops
    # Written: the branch point and each request's end state; not the prompts' own states,
    # each on the way to its request's end.
    prompts = {tuple(system), tuple(first), tuple(other)}
    turn_ends = held - prompts
    assert len(turn_ends) == 2 and prompts <= held
    assert set(eng.prefix_cache.disk.entries) == {tuple(system)} | turn_ends
    convo = first + out1 + prompt_of(5, seed=3)
    turn_end = max(len(k) for k in turn_ends if tuple(convo[: len(k)]) == k)

    again = engine(model, tok, tmp_path, mtp)  # a restart: nothing in memory
    assert again.prefix_cache.bytes == 0
    # A third conversation on the system prompt, the first one's next turn, each from its
    # state on disk, and the first prompt again (from the system prompt's, now in memory).
    later = [system + prompt_of(9, seed=4), convo, first]
    outs, cached = run(again, later)
    assert outs[2] == out1
    for prompt, out in zip(later, outs):
        assert out == reference_greedy(ref, prompt, 12)
    assert cached == [len(system), turn_end, len(system)]
    assert again.prefix_cache.disk.loads == 2


def test_only_states_no_other_extends_and_branch_points_are_written(tmp_path):
    from mlxmtp.engine.prefix_cache import PrefixCache
    from mlxmtp.engine.prefix_disk import DiskPrefixStore
    from mlxmtp.engine.prefix_trie import PrefixTrie

    trie = PrefixTrie()
    for key in [(1, 2, 3), (1, 2, 3, 4, 5), (1, 2, 3, 9), (7, 8)]:
        trie.insert(type("E", (), {"tokens": key})())
    assert trie.next_tokens((1, 2, 3)) == {4, 9} and trie.next_tokens((1, 2)) == {3}
    assert trie.next_tokens((1, 2, 3, 4)) == {5} and trie.next_tokens((1, 2, 3, 4, 5)) == set()
    assert trie.next_tokens((1, 5)) == set() and trie.next_tokens(()) == {1, 7}

    def entry(tokens, boundary=False):
        return type("E", (), {"tokens": tokens, "boundary": boundary})()

    pc = PrefixCache(1 << 20)
    pc.disk = DiskPrefixStore(tmp_path, 1 << 20, "fp", lambda: [[], None])
    pc.disk.trie.insert(entry((1, 2, 3, 4, 5, 6)))  # on disk already
    worth = {key: pc._worth_writing(entry(key)) for key in [(1, 2, 3), (1, 2, 3, 4, 5, 6, 7), (1, 2), (5,)]}
    assert worth == {(1, 2, 3): False, (1, 2, 3, 4, 5, 6, 7): True, (1, 2): False, (5,): True}
    assert pc._worth_writing(entry((1, 2), boundary=True))  # a prefill checkpoint: always
    pc.trie.insert(entry((1, 2, 3, 8)))  # now (1, 2, 3) is a branch point
    assert pc._worth_writing(entry((1, 2, 3))) and not pc._worth_writing(entry((1, 2)))


def test_entries_memory_evicts_come_back_from_disk(fixture_model, tmp_path):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    eng = engine(model, tok, tmp_path, memory=700_000)
    prompts = [prompt_of(200, seed=i) for i in range(5)]
    outs, _ = run(eng, prompts)  # each evicts earlier ones from memory: to disk, where worth it
    pc = eng.prefix_cache
    assert pc.bytes <= 700_000 and tuple(prompts[0]) not in pc.entries
    assert tuple(prompts[0]) not in pc.disk.entries  # on the way to its request's end state:
    (end,) = [k for k in pc.disk.entries if k[:200] == tuple(prompts[0])]  # that one was written
    assert end not in pc.entries and len(end) > 200
    follow = list(end) + prompt_of(7, seed=9)  # the conversation's next turn
    (out,), (cached,) = run(eng, [follow])
    assert out == reference_greedy(ref, follow, 12)
    assert cached == len(end) and pc.disk.loads == 1
    assert end in pc.entries  # back in memory too


def test_another_model_never_reads_these_states(fixture_model, tmp_path):
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    prompt = prompt_of(120, seed=5)
    eng = engine(model, tok, tmp_path)
    run(eng, [prompt])
    eng.prefix_cache.save_to_disk()
    other_dir = write_hf_checkpoint(tmp_path / "other" / "model", "qwen3_5", seed=123)
    other, other_tok, other_ref = loaded(str(other_dir))
    eng2 = engine(other, other_tok, tmp_path / "store")
    eng3 = engine(other, other_tok, tmp_path)  # same folder, another model: its own subfolder
    assert eng3.prefix_cache.disk.folder != eng.prefix_cache.disk.folder and not eng3.prefix_cache.disk.entries
    (out,), (cached,) = run(eng3, [prompt + prompt_of(3, seed=6)])
    assert cached == 0 and out == reference_greedy(other_ref, prompt + prompt_of(3, seed=6), 12)
    assert eng2.prefix_cache.disk.entries == {}
    assert len(engine(model, tok, tmp_path).prefix_cache.disk.entries) > 0  # the first model's are kept


def test_broken_and_half_written_files_are_not_restored(fixture_model, tmp_path):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    eng = engine(model, tok, tmp_path)
    run(eng, [prompt_of(130, seed=7), prompt_of(120, seed=8)])
    eng.prefix_cache.save_to_disk()
    folder = eng.prefix_cache.disk.folder
    (cut, cut_tokens), (garbled, garbled_tokens) = sorted(  # the two requests' end states
        (folder / (p.stem + ".safetensors"), json.loads(p.read_text())["tokens"]) for p in folder.glob("*.json"))
    cut.write_bytes(cut.read_bytes()[:100])  # a disk that filled up, a copy that stopped
    data = garbled.read_bytes()  # the same size, garbage inside: found only when read
    garbled.write_bytes(data[:8] + b"{" * (len(data) - 8))
    (folder / "tmp-1-abc.safetensors").write_bytes(b"partial")  # a write that never finished
    (folder / "0123.safetensors").write_bytes(b"no index beside it")
    again = engine(model, tok, tmp_path)
    for gone in ("tmp-1-abc.safetensors", "0123.safetensors", cut.name, cut.stem + ".json"):
        assert not (folder / gone).exists(), gone
    assert tuple(garbled_tokens) in again.prefix_cache.disk.entries
    for tokens in (cut_tokens, garbled_tokens):
        follow = tokens + prompt_of(4, seed=9)
        (out,), (cached,) = run(again, [follow])
        assert out == reference_greedy(ref, follow, 12) and cached == 0
    assert tuple(garbled_tokens) not in again.prefix_cache.disk.entries and not garbled.exists()


def test_the_folder_stays_within_its_budget(fixture_model, tmp_path):
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    eng = engine(model, tok, tmp_path, memory=400_000, disk=600_000)
    prompts = [prompt_of(180, seed=20 + i) for i in range(8)]
    run(eng, prompts, max_tokens=4)
    disk = eng.prefix_cache.disk
    on_disk = sum(p.stat().st_size for p in disk.folder.iterdir())
    assert disk.bytes == on_disk - sum(p.stat().st_size for p in disk.folder.glob("*.json"))
    assert 0 < disk.bytes <= 600_000 and len(disk.entries) >= 3
    assert tuple(prompts[0]) not in disk.entries  # the oldest went first
    restarted = engine(model, tok, tmp_path, memory=400_000, disk=600_000)
    assert set(restarted.prefix_cache.disk.entries) == set(disk.entries)


def test_attach_refuses_what_it_cannot_serve(fixture_model, tmp_path):
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    with pytest.raises(ValueError, match="one in memory"):
        prefix_disk.attach(BatchGenerator(model, tok, prefix_cache_bytes=0), tmp_path, 1 << 20)
    eng = BatchGenerator(model, tok, prefix_cache_bytes=1 << 20)
    eng.prefix_cache.agree = lambda n: n
    with pytest.raises(ValueError, match="across ranks"):
        prefix_disk.attach(eng, tmp_path, 1 << 20)


def test_a_restarted_server_answers_from_the_states_it_saved(fixture_model, tmp_path):
    """`mlxmtp serve --prefix-cache-dir`: three conversations on one system prompt (the
    second stores the state after it); SIGTERM writes it to disk, and the next server reads
    the system prompt from there (usage counts it as cached) and answers as the first did."""
    ServerProcess = load_bench_module().ServerProcess
    store = tmp_path / "prefix-store"
    system = {"role": "system", "content": "you review code " * 40}
    bodies = [{"model": "m", "max_tokens": 8, "temperature": 0,
               "messages": [system, {"role": "user", "content": text}]} for text in ("hi", "hello there", "what now")]
    answers = []
    for sent in (bodies, bodies[2:]):
        srv = ServerProcess(str(fixture_model("qwen3_5")["hf"]), log_level="info",
                            extra=["--prefix-cache-dir", str(store), "--prefill-step-size", "64"])
        try:
            srv.start(timeout=90)
            for body in sent:
                r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
            answers.append(r.json())
            assert srv.stop() == 0
            assert "prefix cache on disk" in srv.output()
        finally:
            srv.close()
    first, second = answers
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[0] == cached[1] > 100  # the system prompt's state, from memory, then from disk
    assert list(store.iterdir()) and not list(store.glob("*/tmp-*"))


def test_serve_refuses_a_folder_it_cannot_use(tmp_path):
    from click.testing import CliRunner

    from mlxmtp.cli import main

    runner = CliRunner()
    r = runner.invoke(main, ["serve", "--prefix-cache-dir", str(tmp_path / "d"), "--prefix-cache-mb", "0"])
    assert r.exit_code == 2 and "--prefix-cache-mb above 0" in r.output
    (tmp_path / "file").write_text("")
    r = runner.invoke(main, ["serve", "--prefix-cache-dir", str(tmp_path / "file" / "d")])
    assert r.exit_code == 2 and "--prefix-cache-dir" in r.output


def test_the_bench_times_all_three_ways_to_the_same_first_token():
    """bench/prefix_disk.py, tiny: one round of a 300-token prompt on the demo model, and a
    Qwen3.5-27B-sized state of 16 tokens written and read back."""
    from mlxmtp.models.load import load

    bench = load_bench_module("prefix_disk")
    model, tok = load(None)
    row = bench.one_round(model, tok, 300, 1)  # asserts the same first token and one load from disk
    assert row["cold"] > 0 and row["disk"] > 0 and row["mib"] > 0
    large = bench.large_state_round(16)  # Qwen3.5-27B's shapes: mostly its Gated DeltaNet states
    assert 0.14 < large["gib"] < 0.16 and large["write"] > 0 and large["read"] > 0


def test_an_engine_rebuilt_after_a_failure_keeps_the_states_of_the_one_before(start_server, tmp_path):
    """A step that raises outside any one request rebuilds the engine (EngineBridge._recover):
    the old one's prefix cache is written to disk first, and the new one answers from it."""
    srv = start_server(prefix_cache_mb=64, prefix_cache_dir=str(tmp_path), prefill_step=64)
    bridge = srv.state.bridge

    def ask(text):
        body = {"model": "m", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": "you review code " * 40}, {"role": "user", "content": text}]}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    ask("one")
    ask("two")  # stores the state after the system prompt on its way (a branch point)
    shared = ask("three")
    assert shared > 100
    old, restarts = bridge.engine, bridge.restarts

    def broken_step():
        raise RuntimeError("injected engine failure")

    old.step = broken_step  # fails before the request starts: the new engine runs it
    assert ask("four") == shared
    assert bridge.restarts == restarts + 1 and bridge.engine is not old
    assert bridge.engine.prefix_cache.disk.loads == 1
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'mlxmtp_prefix_cache_lookups{result="disk"} 1.0' in metrics
    entries = [ln for ln in metrics.splitlines() if ln.startswith("mlxmtp_prefix_cache_disk_entries ")]
    assert entries and float(entries[0].split()[1]) >= 2  # the branch point and a request's end


def test_a_state_with_logits_on_disk_replaces_the_same_one_without_in_memory(fixture_model, tmp_path):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    prompt = prompt_of(100, seed=30)
    eng = engine(model, tok, tmp_path)
    (out,), _ = run(eng, [prompt])
    # Written as when memory evicted it before its request's end state was stored.
    eng.prefix_cache.disk.save(eng.prefix_cache.entries[tuple(prompt)])
    again = engine(model, tok, tmp_path)
    pc = again.prefix_cache
    stripped = pc.disk.load(pc.disk.entries[tuple(prompt)])  # the prompt's state, as a strict prefix only
    pc.store(prompt, stripped.cache, stripped.head_cache, stripped.pend_h, stripped.pend_t, None)
    held = pc.bytes
    (out2,), (cached,) = run(again, [prompt])
    assert out2 == out == reference_greedy(ref, prompt, 12) and cached == len(prompt)
    assert pc.entries[tuple(prompt)].last_logits.size > 0
    assert pc.bytes == sum(e.nbytes for e in pc.entries.values()) and pc.bytes > held


def test_other_models_folders_leave_when_the_whole_folder_is_over_budget(fixture_model, tmp_path):
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    old = tmp_path / "0123456789abcdef0123"  # another model's (or older versions') entries
    old.mkdir()
    (old / "a.safetensors").write_bytes(b"x" * 300_000)
    (old / "a.json").write_text("{}")
    eng = engine(model, tok, tmp_path, disk=1_000_000)
    assert old.exists()  # within the budget together: kept
    run(eng, [prompt_of(150, seed=40)])
    eng.prefix_cache.save_to_disk()
    engine(model, tok, tmp_path, disk=1_000_000 + 1000)
    assert old.exists()
    again = engine(model, tok, tmp_path, disk=400_000)  # no longer fits beside this model's entries
    assert not old.exists() and again.prefix_cache.disk.entries
    assert again.prefix_cache.disk.bytes <= 400_000


def test_a_store_inside_the_model_folder_keeps_its_fingerprint(fixture_model, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(fixture_model("qwen3_5")["hf"], folder)
    model, tok, _ = loaded(str(folder))
    eng = engine(model, tok, folder / "prefix-store")
    run(eng, [prompt_of(120, seed=41)])
    eng.prefix_cache.save_to_disk()
    again = engine(model, tok, folder / "prefix-store")
    assert again.prefix_cache.disk.folder == eng.prefix_cache.disk.folder and again.prefix_cache.disk.entries


def test_a_full_disk_costs_only_the_saving(fixture_model, tmp_path, monkeypatch, caplog):
    """A write that fails (no space left) leaves no file and no entry; serving goes on."""
    from mlxmtp.engine import prefix_files

    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    eng = engine(model, tok, tmp_path, memory=300_000)
    real = prefix_files.write_atomically

    def write_then_fail(write, tmp):
        write(tmp)  # part of the arrays' file is there when the disk fills up
        raise OSError(28, "No space left on device")

    def full(path, write):
        if path.suffix == ".safetensors":
            write = functools.partial(write_then_fail, write)
        real(path, write)

    monkeypatch.setattr(prefix_files, "write_atomically", full)
    prompts = [prompt_of(200, seed=50 + i) for i in range(4)]
    outs, _ = run(eng, prompts)
    assert [o for o in outs] == [reference_greedy(ref, p, 12) for p in prompts]
    assert not eng.prefix_cache.disk.entries and not list(eng.prefix_cache.disk.folder.iterdir())
    assert "No space left on device" in caplog.text


def test_writes_stop_short_of_filling_the_disk(fixture_model, tmp_path, monkeypatch, caplog):
    """Whatever its budget, the folder never takes the disk's reserve: its own least recently
    used entries make room where they can, and past that nothing is written (warned once)."""
    import shutil
    from collections import namedtuple

    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    eng = engine(model, tok, tmp_path, memory=300_000)
    disk = eng.prefix_cache.disk
    Usage = namedtuple("Usage", "total used free")
    room = {"bytes": 10 << 30}  # free on the disk were the store's files deleted
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(20 << 30, 0, room["bytes"] - disk.bytes))
    run(eng, [prompt_of(200, seed=60 + i) for i in range(3)], max_tokens=4)
    written = set(disk.entries)
    assert len(written) >= 2
    room["bytes"] = prefix_disk.MIN_FREE_BYTES + 300_000  # the disk filled up: room for two entries
    run(eng, [prompt_of(200, seed=70 + i) for i in range(3)], max_tokens=4)
    assert disk.entries and disk.bytes <= 300_000 and not set(disk.entries) & written  # the old made room
    assert not disk.warned_full
    room["bytes"] = prefix_disk.MIN_FREE_BYTES  # no room even without the store's files: kept as they are
    held = set(disk.entries)
    run(eng, [prompt_of(200, seed=80 + i) for i in range(3)], max_tokens=4)
    assert caplog.text.count("has no room left") == 1 and disk.warned_full
    assert set(disk.entries) == held


def test_a_stopping_server_waits_for_a_long_step_and_then_the_write(monkeypatch):
    """EngineBridge.stop: the engine thread writes the prefix cache once its step ends, so
    stop waits past its usual bound when the cache has a disk store (and only then)."""
    import threading
    import time

    from mlxmtp.server import engine_thread

    class SlowEngine:
        has_work = True
        cycles = 0

        def __init__(self, disk):
            self.saved = threading.Event()
            self.prefix_cache = type("PC", (), {"disk": disk, "save_to_disk": lambda _: self.saved.set()})()

        def calibrate(self, _):
            pass

        def step(self):
            time.sleep(0.5)  # a long prefill chunk, say
            return []

    monkeypatch.setattr(engine_thread, "STOP_WAIT", 0.05)
    for disk, waited in ((object(), True), (None, False)):
        eng = SlowEngine(disk)
        bridge = engine_thread.EngineBridge(lambda eng=eng: eng)
        bridge.start()
        time.sleep(0.1)
        bridge.stop()
        assert eng.saved.is_set() == waited
