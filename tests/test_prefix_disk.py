"""The prefix cache's disk tier (engine/prefix/disk.py): entries evicted from memory, and
those held when the engine stops, are written to a folder and loaded back for prompts that
start with them, also by a new engine (a restarted server), giving the output a fresh
prefill gives (mlx-lm's own). Files of another model, broken, half-written or changed ones,
and states of other shapes are never restored (a miss, counted); the folder stays within its
budget, counting and deleting only what the server wrote, never following links, and noticing
when it is deleted under a running server."""

import dataclasses
import functools
import json
import shutil
from unittest import mock

import httpx
import mlx.core as mx
import pytest
from engine_helpers import loaded, prompt_of, reference_greedy
from server_helpers import load_bench_module, served_engine
from test_add_mtp_weights import DEAD_PID

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.build import build_engine
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.coordinator import Coordinator
from mlxmtp.engine.prefix import disk as prefix_disk
from mlxmtp.engine.prefix.folders import MARKER
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
    """An engine whose prefix cache keeps `memory` bytes, and `disk` bytes in `folder` (a
    budget finer than the option's MiB: the store is built with it, as engine/parts.py
    builds it from the option)."""
    config = EngineConfig(enable_mtp=mtp, num_draft=2 if mtp else None, prefix_cache_bytes=memory, prefill_step=64,
                          prefix_cache_dir=str(folder))
    store_for = prefix_disk.store_for
    with mock.patch.object(prefix_disk, "store_for",
                           lambda pieces, m, where, _mib, *rest: store_for(pieces, m, where, disk, *rest)):
        return BatchGenerator(model, tok, config)


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
    from mlxmtp.engine.prefix.cache import PrefixCache
    from mlxmtp.engine.prefix.disk import DiskPrefixStore
    from mlxmtp.engine.prefix.trie import PrefixTrie

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
    temporary, lone = f"tmp-{DEAD_PID}-{'ab' * 16}.safetensors", f"{'01' * 16}.safetensors"
    (folder / temporary).write_bytes(b"partial")  # a write that never finished
    (folder / lone).write_bytes(b"no index beside it")
    writing = f"tmp-1-{'cd' * 16}.safetensors"  # another server's write in progress (PID 1 runs)
    (folder / writing).write_bytes(b"partial")
    again = engine(model, tok, tmp_path)
    for gone in (temporary, lone, cut.name, cut.stem + ".json"):
        assert not (folder / gone).exists(), gone
    assert (folder / writing).exists()
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
    assert disk.bytes == sum(p.stat().st_size for p in disk.folder.glob("*.safetensors"))
    assert 0 < disk.bytes <= 600_000 and len(disk.entries) >= 3
    assert tuple(prompts[0]) not in disk.entries  # the oldest went first
    restarted = engine(model, tok, tmp_path, memory=400_000, disk=600_000)
    assert set(restarted.prefix_cache.disk.entries) == set(disk.entries)


def test_attach_refuses_what_it_cannot_serve(fixture_model, tmp_path):
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    with pytest.raises(ValueError, match="one in memory"):
        BatchGenerator(model, tok, EngineConfig(prefix_cache_bytes=0, prefix_cache_dir=str(tmp_path)))

    class Lockstep(Coordinator):  # a rank's, its sizes its own
        lockstep = True

    with pytest.raises(ValueError, match="across ranks"):
        build_engine(model, tok, EngineConfig(prefix_cache_bytes=1 << 20, prefix_cache_dir=str(tmp_path)), Lockstep())


@pytest.mark.slow
def test_a_restarted_server_answers_from_the_states_it_saved(fixture_model, tmp_path):
    """`mlxmtp serve --prefix-cache-dir`: three conversations on one system prompt (the
    second stores the state after it); SIGTERM writes it to disk, and the next server reads
    the system prompt from there (usage and /metrics count it) and answers as the first did.
    A folder and a link of the user's in the same folder are left alone."""
    ServerProcess = load_bench_module().ServerProcess
    store = tmp_path / "prefix-store"
    (store / "my_notes").mkdir(parents=True)
    (store / "my_notes" / "todo.txt").write_text("mine")
    (store / "link").symlink_to(fixture_model("qwen3_5")["hf"], target_is_directory=True)
    system = {"role": "system", "content": "you review code " * 40}
    bodies = [{"model": "m", "max_tokens": 8, "temperature": 0,
               "messages": [system, {"role": "user", "content": text}]} for text in ("hi", "hello there", "what now")]
    answers, metrics = [], []
    for sent in (bodies, bodies[2:]):
        srv = ServerProcess(str(fixture_model("qwen3_5")["hf"]), log_level="info",
                            extra=["--prefix-cache-dir", str(store), "--prefill-step-size", "64"])
        try:
            srv.start(timeout=90)
            for body in sent:
                r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
            answers.append(r.json())
            metrics.append(httpx.get(srv.url + "/metrics").text)
            assert srv.stop() == 0
            assert "prefix cache on disk" in srv.output() and "holds what the server did not write" in srv.output()
        finally:
            srv.close()
    first, second = answers
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[0] == cached[1] > 100  # the system prompt's state, from memory, then from disk
    assert list(store.iterdir()) and not list(store.glob("*/tmp-*"))
    assert 'mlxmtp_prefix_cache_lookups{result="disk"} 1.0' in metrics[1]
    assert 'mlxmtp_prefix_cache_lookups{result="rejected"} 0.0' in metrics[1]
    assert (store / "my_notes" / "todo.txt").read_text() == "mine" and (store / "link").is_symlink()


def test_serve_refuses_a_folder_it_cannot_use(tmp_path):
    from click.testing import CliRunner

    from mlxmtp.commands.main import main

    runner = CliRunner()
    r = runner.invoke(main, ["serve", "--prefix-cache-dir", str(tmp_path / "d"), "--prefix-cache-mb", "0"])
    assert r.exit_code == 2 and "--prefix-cache-mb above 0" in r.output
    (tmp_path / "file").write_text("")
    r = runner.invoke(main, ["serve", "--prefix-cache-dir", str(tmp_path / "file" / "d")])
    assert r.exit_code == 2 and "--prefix-cache-dir" in r.output


@pytest.mark.slow
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
    srv = start_server(engine=served_engine(prefix_cache_bytes=64 << 20, prefix_cache_dir=str(tmp_path), prefill_step=64))
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
    assert 'mlxmtp_prefix_cache_lookups{result="rejected"} 0.0' in metrics
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
    (old / MARKER).write_text("")
    (old / f"{'a' * 32}.safetensors").write_bytes(b"x" * 300_000)
    (old / f"{'a' * 32}.json").write_text("{}")
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
    from mlxmtp.engine.prefix import files as prefix_files

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
    assert not eng.prefix_cache.disk.entries and [p.name for p in eng.prefix_cache.disk.folder.iterdir()] == [MARKER]
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

        def set_fatal_handler(self, _):
            pass

        def close(self):
            pass

    monkeypatch.setattr(engine_thread, "STOP_WAIT", 0.05)
    for disk, waited in ((object(), True), (None, False)):
        eng = SlowEngine(disk)
        bridge = engine_thread.EngineBridge(lambda eng=eng: eng)
        bridge.start()
        time.sleep(0.1)
        bridge.stop()
        assert eng.saved.is_set() == waited


def test_only_what_the_server_wrote_is_ever_deleted(fixture_model, tmp_path, caplog):
    """Within a budget too small for any entry, and after a restart, the files and folders
    the server did not write (by their names, or outside the subfolders it marked) are left
    alone, and logged once per store."""
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    eng = engine(model, tok, tmp_path)
    run(eng, [prompt_of(150, seed=90), prompt_of(140, seed=91)], max_tokens=4)
    eng.prefix_cache.save_to_disk()
    own = eng.prefix_cache.disk.folder
    theirs = {tmp_path / "my_notes" / "todo.txt": "notes", tmp_path / "readme.txt": "mine",
              # Named like another model's folder and entry, but not marked as the server's.
              tmp_path / "0123456789abcdef0123" / f"{'ab' * 16}.safetensors": "x" * 5000,
              own / "notes.txt": "mine too", own / "sub" / f"{'cd' * 16}.json": "{}",
              own / "tmp-1-abc.safetensors": "not a temporary of the server's", own / f"{'ef' * 16}.bin": "?"}
    for path, text in theirs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    caplog.set_level("INFO", logger="mlxmtp")
    for _ in range(2):  # and a restart
        caplog.clear()
        tiny = engine(model, tok, tmp_path, disk=1000)
        assert not tiny.prefix_cache.disk.entries and tiny.prefix_cache.disk.bytes == 0
        assert not list(own.glob("?" * 32 + ".safetensors")) and (own / MARKER).is_file()
        assert {path: path.read_text() for path in theirs} == theirs
        assert caplog.text.count("holds what the server did not write") == 1


def _forged(state, change: str):
    """`state` with one array of another shape or dtype, or without one (as another model's
    state, or a file made to pass its index's checksums, would be)."""
    cache, head = state.cache.copy(), state.head_cache.copy()
    gdn, kv = cache[0].cache, cache[3]  # the fixture's layer 0 is Gated DeltaNet, layer 3 attention
    if change == "recurrent state":
        gdn[1] = gdn[1][..., :8]
    elif change == "conv state dtype":
        gdn[0] = gdn[0].astype(mx.float16)
    elif change == "no recurrent state":
        gdn[1] = None
    elif change == "KV heads":
        kv.keys, kv.values = kv.keys[:, :1], kv.values[:, :1]
    elif change == "head KV":
        head[0].keys = head[0].keys[..., :8]
    pend_h = state.pend_h[:, :32] if change == "hidden size" else state.pend_h
    logits = state.last_logits[:100] if change == "vocabulary" else state.last_logits
    return dataclasses.replace(state, cache=cache, head_cache=head, pend_h=pend_h, last_logits=logits)


@pytest.mark.slow
def test_a_state_of_other_shapes_is_a_miss_and_deleted(fixture_model, tmp_path):
    """A state whose arrays are not of the model's shapes and dtypes, with an index that
    agrees with them (its checksums too): a miss (counted), deleted, and the answer a
    fresh prefill gives."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    prompt = prompt_of(100, seed=95)
    eng = engine(model, tok, tmp_path / "first")
    run(eng, [prompt], max_tokens=1)
    state = eng.prefix_cache.entries[tuple(prompt)]
    follow = prompt + prompt_of(5, seed=96)
    expected = reference_greedy(ref, follow, 12)
    for i, change in enumerate(["recurrent state", "conv state dtype", "no recurrent state", "KV heads", "head KV",
                                "hidden size", "vocabulary"]):
        folder = tmp_path / f"forged-{i}"
        engine(model, tok, folder).prefix_cache.disk.save(_forged(state, change))
        again = engine(model, tok, folder)
        disk = again.prefix_cache.disk
        assert tuple(prompt) in disk.entries  # the index agrees with the file
        (out,), (cached,) = run(again, [follow])
        assert (out, cached, disk.rejected, disk.loads) == (expected, 0, 1, 0), change
        assert not disk.entries and not list(disk.folder.glob("*.safetensors")), change


def test_a_state_with_changed_bytes_is_a_miss_and_deleted(fixture_model, tmp_path):
    """Bytes flipped inside a state's arrays (the file as long as it was): a miss (counted),
    deleted, and the answer a fresh prefill gives."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    prompt = prompt_of(110, seed=97)
    eng = engine(model, tok, tmp_path)
    run(eng, [prompt])
    eng.prefix_cache.save_to_disk()
    (end,) = eng.prefix_cache.disk.entries.values()  # the request's end state
    data = eng.prefix_cache.disk.folder / (end.name + ".safetensors")
    raw = bytearray(data.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")  # past the header: the arrays
    middle = (start + len(raw)) // 2
    raw[middle : middle + 16] = bytes(b ^ 0x5A for b in raw[middle : middle + 16])
    data.write_bytes(bytes(raw))
    again = engine(model, tok, tmp_path)
    disk = again.prefix_cache.disk
    follow = list(end.tokens) + prompt_of(4, seed=98)
    (out,), (cached,) = run(again, [follow])
    assert out == reference_greedy(ref, follow, 12) and cached == 0
    assert disk.rejected == 1 and disk.loads == 0 and not disk.entries and not data.exists()


def test_symbolic_links_are_never_followed(fixture_model, tmp_path, caplog):
    """Links in the folder and in the model's subfolder (to folders, to files, one named as
    another model's subfolder) stop nothing, within a budget too small for any entry, and
    neither they nor what they point to are touched. A link in place of the model's
    subfolder turns the disk tier off (warned once): nothing is written through it."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    store, outside = tmp_path / "store", tmp_path / "outside"
    eng = engine(model, tok, store)
    run(eng, [prompt_of(120, seed=99)], max_tokens=4)
    eng.prefix_cache.save_to_disk()
    own = eng.prefix_cache.disk.folder
    marked = outside / "marked"  # looks like a folder of the server's, behind a link
    marked.mkdir(parents=True)
    (marked / MARKER).write_text("")
    (marked / f"{'ab' * 16}.safetensors").write_bytes(b"x" * 5000)
    (outside / "kept.txt").write_text("kept")
    links = {store / "link": outside, own / "link": outside, store / "fedcba9876543210fedc": marked,
             own / f"{'cd' * 16}.safetensors": outside / "kept.txt"}
    for link, target in links.items():
        link.symlink_to(target, target_is_directory=target.is_dir())
    before = sorted(str(p) for p in outside.rglob("*"))
    for disk in (1000, 256 << 20):  # too small for any entry, then a restart
        assert engine(model, tok, store, disk=disk).prefix_cache.disk.usable
        assert all(link.is_symlink() for link in links) and sorted(str(p) for p in outside.rglob("*")) == before

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    linked = tmp_path / "linked"
    (linked / own.name).parent.mkdir()
    (linked / own.name).symlink_to(elsewhere, target_is_directory=True)
    caplog.clear()
    off = engine(model, tok, linked)
    prompt = prompt_of(100, seed=100)
    (out,), _ = run(off, [prompt])
    off.prefix_cache.save_to_disk()
    assert out == reference_greedy(ref, prompt, 12) and not off.prefix_cache.disk.usable
    assert not list(elsewhere.iterdir()) and not off.prefix_cache.disk.entries
    assert caplog.text.count("is a symbolic link") == 1


def test_a_folder_deleted_under_a_running_store_is_noticed(fixture_model, tmp_path):
    """`rm -rf` of the folder while engines run: the next write re-creates it (marked) and
    writes the states again, and a state whose files are gone is a miss that has the store
    read the folder again, so its entries are those on disk."""
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    store = tmp_path / "store"
    eng = engine(model, tok, store)
    run(eng, [prompt_of(130, seed=101), prompt_of(125, seed=102)], max_tokens=4)
    pc = eng.prefix_cache
    pc.save_to_disk()
    written = set(pc.disk.entries)
    assert len(written) == 2
    again = engine(model, tok, store)  # knows the two from the files
    shutil.rmtree(store)
    pc.save_to_disk()
    folder = pc.disk.folder
    assert set(pc.disk.entries) == written and len(list(folder.glob("*.json"))) == 2 and (folder / MARKER).is_file()
    assert pc.disk.bytes == sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    shutil.rmtree(store)
    follow = list(max(written, key=len)) + prompt_of(3, seed=103)
    (out,), (cached,) = run(again, [follow])
    assert out == reference_greedy(ref, follow, 12) and cached == 0
    assert not again.prefix_cache.disk.entries and again.prefix_cache.disk.bytes == 0
    assert (folder / MARKER).is_file()
