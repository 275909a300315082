"""Distributed runs: 2 ranks on this machine over loopback (MLX's ring backend).

Fast tests check the pieces in one process (plan, wire format, start-up check, shared
policy on a group of one); the slow ones launch 2 ranks: greedy output identical to
mlx-lm's for the demo model and two fixture families (one MoE) at plain, shallow, the
deepest and adaptive drafting, batch 1 and 4, sampling that passes the chi-square test, the
CLI, the server on rank 0, and the faults (a rank killed or stopped mid-request, mismatched
folders)."""

import json
import shutil
import time

import pytest
from dist_helpers import BIN, WORKER, last_json, mlx_launch, run_worker
from distributed_worker import SAMPLED
from engine_helpers import asked_again, hub_from_folder, loaded, prompt_of, reference_greedy

from mlxmtp.checkpoint.split_plan import layer_split, make_plan
from mlxmtp.distributed.channel import Channel
from mlxmtp.distributed.group import check_same_setup, folder_fingerprint
from mlxmtp.distributed.shared_policy import SharedPolicy
from mlxmtp.distributed.watchdog import Watchdog
from mlxmtp.distributed.wire import request_from_wire, request_to_wire, with_seed
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.policy.base import Policy
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.models.demo import demo_model_path
from mlxmtp.server.thinking_budget import budget_processor
from mlxmtp.testing.fixtures import write_hf_checkpoint

DEMO = str(demo_model_path())
WORKER_PYTHON = BIN / "python"


# ------------------------------------------------------------------ one process
def test_plan_splits_layers_like_mlx_lm_and_counts_each_ranks_bytes():
    plan = make_plan(demo_model_path(), 2)
    assert [r.layers for r in plan.ranks] == [[4, 8], [0, 4]]  # rank 0 runs the last layers
    assert sum(plan.layer_bytes) + plan.shared_bytes + plan.head_bytes == plan.total_bytes
    for r in plan.ranks:  # its layers, plus what every rank holds
        start, end = r.layers
        assert r.bytes == sum(plan.layer_bytes[start:end]) + plan.shared_bytes + plan.head_bytes
    assert max(r.bytes for r in plan.ranks) < plan.total_bytes
    assert layer_split(9, 2) == [5, 4] and layer_split(8, 3) == [3, 3, 2]
    with pytest.raises(ValueError, match="at most one rank per layer"):
        make_plan(demo_model_path(), 9)


def test_plan_of_a_sharded_checkpoint_reads_only_each_ranks_files(tmp_path):
    path = write_hf_checkpoint(tmp_path / "m", "qwen3_next", num_shards=4, num_hidden_layers=8)
    plan = make_plan(path, 2)
    files = [set(r.files) for r in plan.ranks]
    assert all(files) and files[0] != files[1]
    assert plan.head_bytes > 0  # the HF checkpoint's mtp.* tensors, on every rank


def test_inspect_prints_the_plan(tmp_path):
    from click.testing import CliRunner

    from mlxmtp.commands.main import main

    out = CliRunner().invoke(main, ["inspect", DEMO, "--ranks", "2", "--json"])
    assert out.exit_code == 0, out.output
    plan = json.loads(out.output)["distributed"]
    assert plan["split"] == "pipeline" and [r["layers"] for r in plan["ranks"]] == [[4, 8], [0, 4]]
    assert all(r["bytes"] > 0 for r in plan["ranks"])


def test_requests_travel_whole_and_sampled_ones_get_a_seed():
    budget = budget_processor(7, 3, 11, 12, True)
    req = with_seed(Request(prompt=[1, 2, 3], max_tokens=9, stop=["x"], num_draft=2, logprobs=1,
                            params=SamplingParams(temperature=0.7, top_k=5, logit_bias={4: -2.0},
                                                  logits_processors=[budget])))
    assert req.params.seed is not None
    back = request_from_wire(json.loads(json.dumps(request_to_wire(req))))
    assert (back.id, back.prompt, back.max_tokens, back.stop, back.num_draft, back.logprobs) == \
        (req.id, req.prompt, 9, ["x"], 2, 1)
    assert back.params.seed == req.params.seed and back.params.logit_bias == {4: -2.0}
    assert back.params.top_k == 5 and back.params.logits_processors[0].recipe == budget.recipe
    greedy = with_seed(Request(prompt=[1]))
    assert greedy.params.seed is None  # greedy needs none


def test_a_processor_without_recipe_is_refused():
    req = Request(prompt=[1], params=SamplingParams(logits_processors=[lambda ctx, logits: logits]))
    with pytest.raises(ValueError, match="across machines"):
        request_to_wire(req)


def _group_of_one():
    import mlx.core as mx

    return mx.distributed.init()


def test_channel_and_shared_policy_on_a_group_of_one():
    channel = Channel(_group_of_one())
    big = {"new": [{"prompt": list(range(500))}], "cancel": [3]}
    assert channel.share(big) == big and channel.share({"x": 1}) == {"x": 1}
    assert channel.share_ints([7, -2], 2) == [7, -2]

    class Scripted(Policy):
        max_depth = 4
        why = "scripted"

        def choose(self, batch_size, limit=None, classes=None, requests=None):
            return 3

        def needs_costs(self, batch_size):
            return True

    shared = SharedPolicy(Scripted(), channel)
    assert shared.choose(1) == 3 and shared.needs_costs(1) and not shared.plain_regime()
    assert shared.why == "scripted" and shared.max_depth == 4
    # What a cycle's suffix drafts are planned by (hybrid_plan) is rank 0's too, "none" included.
    assert channel.share_floats([0.5, float("nan")], 2)[0] == 0.5
    assert shared.expected_tokens() is None and shared.relative_costs(1, None, [2, 8]) is None

    class Estimating(Scripted):
        def expected_tokens(self, optimistic=False, classes=(None,)):
            return [1.0, 1.75, 2.25, 2.5, 2.6]

        def relative_costs(self, batch_size, classes, depths, cautious=False):
            return {k: 1 + (0.3 if cautious else 0.2) * k for k in depths if k < 8}

    shared = SharedPolicy(Estimating(), channel)
    assert shared.expected_tokens() == pytest.approx([1.0, 1.75, 2.25, 2.5, 2.6])
    assert shared.relative_costs(1, None, [2, 8], cautious=True) == {2: pytest.approx(1.6)}


def test_the_watchdog_counts_silence_not_the_length_of_a_block():
    stalls = []
    dog = Watchdog(0.5, stalls.append)
    with dog.watch("a long block"):
        for _ in range(15):  # 0.75 s in all, alive every 0.05 s
            time.sleep(0.05)
            dog.alive()
    assert not stalls
    with dog.watch("a stalled block"):
        time.sleep(1.0)
    assert stalls == ["no answer from the other ranks for 0.5s during a stalled block (a rank died or stalled)"]


def test_a_calibration_longer_than_the_timeout_is_not_taken_for_a_stall(fixture_model):
    """The start-up calibration runs ~200 forwards (on a big model split across machines, tens
    of seconds; the first of each shape compiles), where `--dist-timeout` bounds one step: it is
    watched by its progress, each timed run, not by its whole length. Each run here is followed
    by a pause of the caller's, so that the whole lasts past twice the timeout on any machine
    while no run comes near it."""
    from mlxmtp.distributed.engine import DistributedEngine
    from mlxmtp.engine.policy import calibration
    from mlxmtp.models.load import load

    model, tok = load(str(fixture_model("qwen3_5")["hf"]))
    fatal = []
    engine = DistributedEngine(model, tok, group=_group_of_one(), dist_timeout=60, on_fatal=fatal.append)
    engine.watchdog.timeout = 1.5
    runs = []

    def progress():
        runs.append(1)
        time.sleep(0.06)

    t = time.monotonic()
    assert engine.calibrate(1, progress=progress) and not fatal
    policy = engine.engine.policy
    assert len(runs) == 2 * (policy.max_depth + 1) * (calibration.REPS + 1)  # the caller's progress too
    assert time.monotonic() - t > 2 * engine.watchdog.timeout  # 60 runs: at least 3.6 s
    assert not policy.needs_costs(1)  # the costs are in


def test_start_up_check_compares_folders_and_settings(tmp_path):
    a = write_hf_checkpoint(tmp_path / "a", "qwen3_5")
    b = shutil.copytree(a, tmp_path / "b")
    assert folder_fingerprint(a) == folder_fingerprint(b)
    cfg = json.loads((b / "config.json").read_text())
    cfg["text_config"]["rms_norm_eps"] = 1e-5
    (b / "config.json").write_text(json.dumps(cfg))
    assert folder_fingerprint(a) != folder_fingerprint(b)
    check_same_setup(Channel(_group_of_one()), a, EngineConfig(num_draft=2))  # one rank agrees with itself


# ------------------------------------------------------------------ 2 ranks
PROMPTS = [prompt_of(n, seed=n) for n in (5, 23, 61, 140)]


@pytest.mark.slow
def test_two_ranks_greedy_equals_mlx_lm(fixture_model):
    """One launch, three models: two fixture families (one MoE), their random heads' drafts
    rejected (the rollback of 1 and of 4 drafts, plain decoding and the adaptive policy's
    choice, at batch 1 and 4; the MoE at its deepest, batch 4), and the trained demo model,
    whose head adds the cycles that keep drafts (at depths 1 and 3 and the adaptive policy's,
    batch 4, with suffix drafts beside the head: one prompt is the demo asked again, which it
    re-writes). Every depth and batch in one process: tests/test_engine_exact.py."""
    jobs = [dict(model=str(fixture_model("qwen3_next")["hf"]), prompts=PROMPTS[:3], max_tokens=10,
                 depths="0,1,4,adaptive"),
            dict(model=str(fixture_model("qwen3_6_moe")["hf"]), prompts=PROMPTS[:3], max_tokens=10,
                 depths="4", batches=[4])]
    _, tok, demo = loaded(DEMO)
    jobs.append(dict(model=DEMO, prompts=PROMPTS[:3] + [asked_again(tok, demo, 24)], max_tokens=16,
                     depths="1,3,adaptive", batches=[4], suffix=True))
    got = run_worker("greedy", "--jobs", json.dumps(jobs))
    for job, result in zip(jobs, got["result"], strict=True):
        _, _, ref = loaded(job["model"])
        want = [reference_greedy(ref, p, job["max_tokens"]) for p in job["prompts"]]
        assert len(result["tokens"]) == len(job.get("batches", (1, 4))) * len(job["depths"].split(","))
        for setting, tokens in result["tokens"].items():
            assert tokens == want, (job["model"], setting)
    # The demo asked again re-writes its answer: the ranks drafted it from the suffix, planned alike.
    assert got["result"][-1]["kept_by"].get("suffix", 0) > 0


@pytest.mark.slow
def test_ranks_that_decode_differently_stop_the_run():
    res = mlx_launch([str(WORKER_PYTHON), str(WORKER), "disagree", "--model", DEMO,
                      "--prompts", json.dumps(PROMPTS[:1]), "--max-tokens", "8"], timeout=300)
    # mlx.launch exits 0 whatever its ranks did; `mlxmtp launch` fails with them.
    assert res.returncode == 1, res.stderr[-2000:]
    assert not [line for line in res.stdout.splitlines() if line.startswith("{")]
    assert "rank 1 decoded other tokens than rank 0" in res.stderr


@pytest.mark.slow
def test_two_ranks_sample_the_tokens_one_process_samples():
    """MTP sampling on 2 ranks draws exactly what one process draws from the same seeds (the
    same depth and batch): the ranks agree on every draw, so the distribution is the one
    process's, which tests/test_sampling_exact.py proves is the target's. Exact equality is
    a stronger check than a chi-square of the two and needs a tenth of the samples. Then the
    same with suffix drafts beside the head, on the ranks alone (their plans follow timings)."""
    from mlxmtp.engine.batch import BatchGenerator
    from mlxmtp.models.load import load

    model, tok = load(DEMO)
    n, temperature = 64, 0.5
    prompt = [5, 17, 42, 9, 33, 2]
    engine = BatchGenerator(model, tok, SAMPLED)  # the workers' engine config
    for s in range(n):
        engine.submit(Request(prompt=prompt, max_tokens=3, params=SamplingParams(temperature=temperature, seed=s)))
    want = {}
    while engine.has_work:
        for ev in engine.step():
            want.setdefault(ev.request_id, []).extend(ev.token_ids)
    again = asked_again(tok, loaded(DEMO)[2], 24)
    res = run_worker("sample", "--model", DEMO, "--n", str(n), "--seed0", "0",
                     "--temperature", str(temperature), "--again", json.dumps(again))["result"]
    assert res["tokens"] == list(want.values())
    assert len({tuple(t) for t in res["tokens"]}) > n // 4  # sampled, not one greedy answer
    # Sampled rows with suffix drafts beside the head (the demo asked again re-writes its
    # answer): every rank drew the same tokens (a rank that did not stops the run), the suffix's
    # drafts kept among them.
    assert res["kept_by"].get("suffix", 0) > 0


@pytest.mark.slow
def test_generate_cli_on_two_ranks_reports_the_split_and_matches_one_process():
    args = ["generate", "--prompt", "def fib(n):", "--max-tokens", "24", "--json"]
    res = mlx_launch(["mlxmtp", *args])
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 alone prints
    two = json.loads(lines[0])
    from click.testing import CliRunner

    from mlxmtp.commands.main import main

    one = json.loads(CliRunner().invoke(main, args).output.splitlines()[-1])
    assert two["token_ids"] == one["token_ids"]
    dist = two["stats"]["distributed"]
    assert dist["ranks"] == 2 and dist["split"] == "pipeline" and dist["layers"] == [[4, 8], [0, 4]]
    import mlx.core as mx

    from mlxmtp.distributed.load import weight_bytes
    from mlxmtp.models.load import load

    before = mx.get_active_memory()
    mx.reset_peak_memory()
    whole = weight_bytes(load(DEMO)[0])
    one_process_peak = mx.get_peak_memory() - before
    # Loading never held the whole model on one rank: each peaked below one process's load.
    assert max(dist["load_peak_bytes_per_rank"]) < one_process_peak
    plan = make_plan(demo_model_path(), 2)
    for r, held in zip(plan.ranks, dist["bytes_per_rank"]):  # each rank lacks exactly the others' layers
        start, end = r.layers
        assert whole - held == sum(plan.layer_bytes) - sum(plan.layer_bytes[start:end])
    assert dist["control_messages"] > 0


def test_last_json_takes_rank_zeros_line():
    assert last_json('log\n{"a": 1}\nmore\n') == {"a": 1}


def test_a_rank_fetches_only_its_files_from_the_hub(tmp_path, monkeypatch):
    """A Hub id: the configs first, then this rank's weight files only (huggingface_hub's
    snapshot_download stood in for by a copy of a local checkpoint, by its patterns)."""
    from mlxmtp.distributed import load as dist_load
    from mlxmtp.models import model_folder

    source = write_hf_checkpoint(tmp_path / "hub", "qwen3_next", num_shards=4, num_hidden_layers=8)
    hub_from_folder(monkeypatch, source, tmp_path / "cache", "org/model")
    configs = model_folder.resolve_model_path("org/model", weight_files=[])
    assert not list(configs.glob("*.safetensors"))  # the configs come first, alone
    folder, plan = dist_load.fetch_share("org/model", configs, 1, 2)
    fetched = {f.name for f in folder.glob("*.safetensors")}
    assert fetched == set(plan.share(1).files) and fetched != {f.name for f in source.glob("*.safetensors")}
    assert plan.share(1).bytes == make_plan(source, 2).share(1).bytes  # its own share, whole
