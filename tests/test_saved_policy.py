"""What the depth policy learnt, kept for the next run (engine/policy/saved.py)."""

import json
import logging
import math
from unittest import mock

import pytest
from click.testing import CliRunner
from engine_helpers import loaded, prompt_of, reference_greedy
from test_adaptive import simulate

from mlxmtp.commands.main import main as cli
from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.policy import saved
from mlxmtp.engine.policy.adaptive import DepthPolicy
from mlxmtp.engine.policy.base import GREEDY
from mlxmtp.engine.policy.config import CALIBRATING
from mlxmtp.engine.prefix.check import seal
from mlxmtp.engine.request import Request
from mlxmtp.models.load import load

# A machine where drafting is cheap (a large model on an Apple GPU, as estimated).
COSTS = {k: 1.0 + 0.12 * k for k in range(5)}


def started(policy=None) -> DepthPolicy:
    """A policy as an engine starts one: its start-up calibration priced the one-row tables."""
    policy = policy or DepthPolicy()
    policy.seed_costs(1, COSTS)
    return policy


def reasons(policy: DepthPolicy, batch: int, cycles: int, seed: int = 0) -> list:
    """Why `policy` chose each depth over `cycles` simulated cycles of `batch` rows."""
    whys, choose = [], policy.choose
    policy.choose = lambda *a, **kw: (choose(*a, **kw), whys.append(policy.why))[0]
    simulate(lambda k: COSTS[k], 0.8, cycles=cycles, seed=seed, batch=batch, policy=policy, starts=(0,),
             cls=lambda i: GREEDY)
    del policy.choose
    return whys


def test_a_restored_policy_goes_on_where_the_last_run_stopped():
    first = started()
    assert CALIBRATING in reasons(first, batch=4, cycles=300)  # a batch size never seen: its blocks
    state = json.loads(json.dumps(saved.state_of(first)))  # as the file holds it
    again = started()
    saved.restore(again, state)
    table, was = again.costs[4, GREEDY], first.costs[4, GREEDY]
    assert {p: list(w) for p, w in table.pairs.items()} == {p: list(w) for p, w in was.pairs.items()}
    assert list(table.jitter) == list(was.jitter) and again.anchors == first.anchors
    assert again.accept.estimate(GREEDY, 3) == first.accept.estimate(GREEDY, 3)
    assert again.costs[1, GREEDY].priors == started().costs[1, GREEDY].priors  # this run's calibration
    assert CALIBRATING not in reasons(again, batch=4, cycles=60, seed=1)
    assert CALIBRATING in reasons(started(), batch=4, cycles=60, seed=1)  # where a cold one measures


def _file(tmp_path, policy=None) -> saved.SavedPolicy:
    store = saved.SavedPolicy(tmp_path, "fp")
    policy = policy or started()
    reasons(policy, batch=2, cycles=150)
    store.save(policy, force=True)
    return store


def _rewritten(store, change) -> None:
    """The store's file with its policy changed by `change` and a checksum that matches."""
    doc = json.loads(store.path.read_text())
    change(doc["policy"])
    store.path.write_text(seal(doc))


BROKEN = {
    "truncated": lambda store: store.path.write_text(store.path.read_text()[:-40]),
    "a digit changed": lambda store: store.path.write_text(store.path.read_text().replace('"n": ', '"n": 1', 1)),
    "another model": lambda store: store.path.write_text(store.path.read_text().replace('"fp"', '"fq"')),
    "not JSON": lambda store: store.path.write_bytes(b"\x00\xff" * 10),
    "a cost ratio of e^50": lambda store: _rewritten(store, lambda p: p["tables"][-1]["pairs"][0][2].append(50.0)),
    "NaN": lambda store: _rewritten(store, lambda p: p["tables"][-1]["jitter"].append(math.nan)),
    "more kept than tried": lambda store: _rewritten(store, lambda p: p["acceptance"][0]["kept"].__setitem__(1, 1e6)),
    "an unknown class": lambda store: _rewritten(store, lambda p: p["first_drafts"][0].__setitem__("class", "x")),
    "a batch of 3": lambda store: _rewritten(store, lambda p: p["tables"][0].__setitem__("bucket", 3)),
    "a depth too deep": lambda store: _rewritten(store, lambda p: p["acceptance"][0].__setitem__("depth", 9)),
    "a table that is a list": lambda store: _rewritten(store, lambda p: p["tables"].append([1, 2])),
    "a number past a float": lambda store: _rewritten(store, lambda p: p["tables"][-1]["jitter"].append(10**400)),
    "nested past the parser": lambda store: store.path.write_text("[" * 100_000 + "]" * 100_000),
    "a link to a good file": lambda store: (store.path.rename(store.path.with_name("elsewhere")),
                                            store.path.symlink_to(store.path.with_name("elsewhere"))),
}


@pytest.mark.parametrize("how", list(BROKEN))
def test_a_file_that_is_not_what_it_writes_is_ignored_whole(tmp_path, how):
    store = _file(tmp_path)
    assert store.load_into(started())  # intact, it is read
    BROKEN[how](store)
    policy = started()
    assert not store.load_into(policy)
    assert all(not t.pairs for t in policy.costs.values()) and not policy.accept.kept
    assert CALIBRATING in reasons(policy, batch=2, cycles=30)  # it starts cold


def test_it_writes_its_own_file_and_touches_nothing_else(tmp_path, caplog):
    mine = tmp_path / "state"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    (mine / "other.json").write_text("{}")
    store = _file(mine)
    store.save(started(), force=True)  # replaced whole, in place
    assert sorted(p.name for p in mine.iterdir()) == ["fp.json", "notes.txt", "other.json"]
    assert (mine / "notes.txt").read_text() == "the user's" and (mine / "other.json").read_text() == "{}"
    deeper = _file(tmp_path / "a" / "b")  # a folder made where there is none
    assert deeper.path.is_file()
    blocked = tmp_path / "a-file"
    blocked.write_text("x")
    with caplog.at_level(logging.DEBUG, logger="mlxmtp"):
        store = _file(blocked)  # cannot be written: the run goes on
        policy = started()
        reasons(policy, batch=2, cycles=20)
        store.save(policy, force=True)
    assert blocked.read_text() == "x"
    said = [r.levelno for r in caplog.records if "cannot write" in r.getMessage()]
    assert said == [logging.WARNING, logging.DEBUG]  # warned once


def _run(path: str, folder, **config) -> tuple:
    """(tokens, reasons of its cycles) of one request on an engine of a freshly loaded model,
    as a new process would run it; the engine's policy kept in `folder`."""
    model, tok = load(path)
    engine = BatchGenerator(model, tok, EngineConfig(policy_state_dir=str(folder), **config))
    engine.submit(Request(prompt=prompt_of(12), max_tokens=48))
    tokens, whys = [], []
    while engine.has_work:
        for ev in engine.step():
            tokens += ev.token_ids
            whys = list(ev.stats.depth_reasons) if ev.stats is not None else whys
    return tokens, whys


def test_an_engine_started_again_starts_warm_and_writes_the_same_tokens(fixture_model, tmp_path):
    path = str(fixture_model("qwen3_5")["hf"])
    first, whys = _run(path, tmp_path)
    (written,) = tmp_path.iterdir()
    assert CALIBRATING in whys
    again, whys = _run(path, tmp_path)
    assert CALIBRATING not in whys
    assert first == again == reference_greedy(loaded(path)[2], prompt_of(12), 48)
    _run(path, tmp_path, suffix_drafts=True)  # other settings: a file of their own
    assert len(list(tmp_path.iterdir())) == 2 and written.is_file()


def test_generate_keeps_it_where_the_option_says(fixture_model, tmp_path):
    path = str(fixture_model("qwen3_5")["hf"])

    def reasons_of(folder):
        res = CliRunner().invoke(cli, ["generate", "--model", path, "--prompt", "def f(x):", "--no-chat-template",
                                       "-m", "40", "--json", "--policy-state-dir", folder])
        assert res.exit_code == 0, res.output
        return json.loads(res.output)["stats"]["depth_reasons"]

    assert CALIBRATING in reasons_of("none") and CALIBRATING in reasons_of("none")
    assert CALIBRATING in reasons_of(str(tmp_path))
    assert CALIBRATING not in reasons_of(str(tmp_path))


@pytest.mark.parametrize("args,env,folder", [
    ([], {"MLXMTP_POLICY_STATE_DIR": None}, "~/.cache/mlxmtp/policy"),  # on by default
    (["--policy-state-dir", "/tmp/p"], {}, "/tmp/p"),
    ([], {"MLXMTP_POLICY_STATE_DIR": "/tmp/q"}, "/tmp/q"),
    (["--policy-state-dir", "None"], {"MLXMTP_POLICY_STATE_DIR": None}, None),
])
def test_serve_passes_the_folder_to_its_engines(args, env, folder):
    with mock.patch("mlxmtp.commands.serve._load", side_effect=RuntimeError("stop")) as load:
        CliRunner().invoke(cli, ["serve", "--port", "0", *args], env=env)
    assert load.call_args.args[2].policy_state_dir == folder
