"""What the commands say when the model cannot be used: one line, never a traceback.

Every command that loads a model (generate, serve, bench, draft-vocab, inspect) refuses a
path that is not a model folder, a repo it cannot fetch, files mlx-lm cannot read and a
head that cannot be read, naming the folder and what to do.
"""

import json
import logging
import shutil
from pathlib import Path
from unittest import mock

import pytest
from click.testing import CliRunner
from huggingface_hub.errors import LocalEntryNotFoundError

from mlxmtp.commands.main import main
from mlxmtp.testing.fixtures import write_hf_checkpoint, write_mlx_conversion

RUN = "mlxmtp.server.shutdown.run_server"  # serving itself; mocked so nothing blocks
COMMANDS = {
    "generate": ["generate", "-p", "x", "--model"],
    "serve": ["serve", "--port", "0", "--model"],
    "bench": ["bench", "-p", "8", "-g", "2", "--model"],
    "draft-vocab": ["draft-vocab", "--size", "4", "--corpus", __file__, "--out", "/tmp/unused.json", "--model"],
    "inspect": ["inspect"],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Folders that are not usable models, each with the words its error must contain."""
    root = tmp_path_factory.mktemp("bad_models")
    hf = write_hf_checkpoint(root / "hf", "qwen3_5")
    (root / "a_file").write_text("not a model")
    (root / "empty").mkdir()
    shutil.copytree(hf, root / "no_weights", ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.copytree(hf, root / "bad_config")
    (root / "bad_config" / "config.json").write_text("{not json")
    return {
        "missing": (str(root / "nowhere"), "no such model folder"),
        "a_file": (str(root / "a_file"), "is not a folder"),
        "empty": (str(root / "empty"), "it has no config.json"),
        "no_weights": (str(root / "no_weights"), "it has no *.safetensors weights"),
        "bad_config": (str(root / "bad_config"), "bad_config"),
        "not_a_repo_id": ("a/b/c", "no such model folder: a/b/c"),
        # Relative to `root` (the test's working folder), where a folder `empty` exists.
        "beside_a_folder": ("empty/qwen", "no such model folder: empty/qwen"),
    }


CASES = ["missing", "a_file", "empty", "no_weights", "bad_config", "not_a_repo_id", "beside_a_folder"]


# draft-vocab reads a model's tokenizer and configs alone: a folder without weights is fine there.
@pytest.mark.parametrize("command, case", [(c, case) for c in COMMANDS for case in CASES
                                           if (c, case) != ("draft-vocab", "no_weights")])
def test_a_path_that_is_no_model_is_one_line(models, command, case, monkeypatch):
    path, words = models[case]
    monkeypatch.chdir(Path(models["missing"][0]).parent)
    with mock.patch(RUN) as run:
        res = CliRunner().invoke(main, [*COMMANDS[command], path])
    assert res.exit_code == 1 and res.output.startswith("Error: "), res.output
    assert words in res.output and "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)  # click's exit, no crash
    run.assert_not_called()


@pytest.mark.parametrize("command", ["generate", "serve", "draft-vocab", "inspect"])
def test_a_repo_that_cannot_be_fetched_is_one_line(command):
    offline = LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub.\nMore.")
    with mock.patch("mlxmtp.models.hub.snapshot_download", side_effect=offline), mock.patch(RUN) as run:
        res = CliRunner().invoke(main, [*COMMANDS[command], "Qwen/Qwen3-Next-80B-A3B-Instruct"])
    assert res.exit_code == 1, res.output
    assert res.output.strip().splitlines() == [
        "Error: cannot fetch Qwen/Qwen3-Next-80B-A3B-Instruct from Hugging Face, and it is not in the local cache "
        "(An error happened while trying to locate the files on the Hub.); nor is it a folder here. Check the "
        "network, or fetch it first with `hf download Qwen/Qwen3-Next-80B-A3B-Instruct`"]
    run.assert_not_called()


@pytest.mark.parametrize("command", ["generate", "inspect"])
def test_a_repo_not_cached_in_offline_mode_says_how_to_fetch_it(command, tmp_path, monkeypatch):
    import huggingface_hub.constants as hfc

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hfc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hfc, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    res = CliRunner().invoke(main, [*COMMANDS[command], "fake-org/not-cached"])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert "cannot fetch fake-org/not-cached from Hugging Face, and it is not in the local cache" in res.output
    assert ("Hugging Face's offline mode is on (HF_HUB_OFFLINE): fetch it once with `hf download "
            "fake-org/not-cached` with the variable unset") in res.output


@pytest.fixture(scope="module")
def repaired(tmp_path_factory):
    """A 4-bit MLX conversion whose head add-mtp-weights wrote into mtp/."""
    root = tmp_path_factory.mktemp("repaired")
    hf = write_hf_checkpoint(root / "hf", "qwen3_5")
    model = write_mlx_conversion(hf, root / "mlx", bits=4)
    res = CliRunner().invoke(main, ["add-mtp-weights", "--model", str(model), "--source", str(hf)])
    assert res.exit_code == 0, res.output
    return model, hf


def _break_head(repaired, tmp_path, how: str):
    model, _ = repaired
    broken = tmp_path / how
    shutil.copytree(model, broken)
    if how == "cut_weights":
        weights = broken / "mtp" / "weights.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    elif how == "bad_json":
        (broken / "mtp" / "config.json").write_text("{")
    elif how == "other_format":
        config = json.loads((broken / "mtp" / "config.json").read_text())
        (broken / "mtp" / "config.json").write_text(json.dumps({**config, "format_version": 99}))
    else:  # a config without the head's fields
        (broken / "mtp" / "config.json").write_text(json.dumps({"format": "something else"}))
    return broken


@pytest.mark.parametrize("how", ["cut_weights", "bad_json", "other_format", "fields_missing"])
def test_a_head_that_cannot_be_read_is_one_line_and_may_fall_back(repaired, tmp_path, how, caplog):
    broken = str(_break_head(repaired, tmp_path, how))
    res = CliRunner().invoke(main, ["generate", "--model", broken, "-p", "x", "-m", "2", "--enable-mtp"])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert f"Error: the MTP head in {broken} cannot be read" in res.output
    assert "mlxmtp add-mtp-weights" in res.output and "--force" in res.output
    res = CliRunner().invoke(main, ["generate", "--model", broken, "-p", "x", "-m", "2", "--mtp-fallback", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip().splitlines()[-1])["stats"]["mtp_active"] is False
    caplog.set_level(logging.INFO, logger="mlxmtp")
    with mock.patch(RUN) as run:  # serve without --enable-mtp: serves, MTP off, and says why
        res = CliRunner().invoke(main, ["serve", "--port", "0", "--model", broken])
    assert res.exit_code == 0, res.output
    assert not run.call_args.args[0].state.server.mtp_active and "cannot be read" in caplog.text
    res = CliRunner().invoke(main, ["inspect", broken])
    if how == "cut_weights":  # inspect reads the head's config alone
        assert res.exit_code == 0 and "MTP head:     present" in res.output, res.output
    else:
        assert res.exit_code == 1 and "cannot be read" in res.output and "Traceback" not in res.output


def test_generate_refuses_an_empty_prompt_and_stays_within_the_context(tmp_path):
    path = str(write_hf_checkpoint(tmp_path / "m", "qwen3_5", max_position_embeddings=24))
    for prompt in ([], ["--prompt", "-"]):
        res = CliRunner().invoke(main, ["generate", "--model", path, "--no-chat-template", "-p", "", *prompt], input="")
        assert res.exit_code == 2 and "the prompt is empty" in res.output, res.output
    res = CliRunner().invoke(main, ["generate", "--model", path, "--no-chat-template", "-p", "a b c d e f",
                                    "-m", "100", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    room = 24 - out["prompt_tokens"]
    assert f"--max-tokens 100 capped at {room}" in res.stderr
    assert len(out["token_ids"]) <= room
    res = CliRunner().invoke(main, ["generate", "--model", path, "--no-chat-template", "-p", "word " * 30])
    assert res.exit_code == 2 and "fill the model's context of 24" in res.output


def test_option_errors_name_the_option_and_contradictions_are_told(tmp_path, caplog):
    path = str(write_hf_checkpoint(tmp_path / "m", "qwen3_5"))
    res = CliRunner().invoke(main, ["generate", "--model", path, "-p", "x", "--seed", "-1"])
    assert res.exit_code == 2 and "Invalid value for --seed: seed must be in" in res.output, res.output
    res = CliRunner().invoke(main, ["generate", "--model", path, "-p", "x", "-m", "2", "--disable-mtp",
                                    "--num-draft", "3"])
    assert res.exit_code == 0 and "--num-draft has no effect with --disable-mtp" in res.stderr
    caplog.set_level(logging.INFO, logger="mlxmtp")
    with mock.patch(RUN):
        res = CliRunner().invoke(main, ["serve", "--model", path, "--port", "0", "--disable-mtp", "--num-draft", "3"])
    assert res.exit_code == 0 and "--num-draft has no effect with --disable-mtp" in caplog.text
    assert "serving on" not in caplog.text  # port 0: uvicorn's line gives the port it got
    res = CliRunner().invoke(main, ["bench", "-p", ""])
    assert res.exit_code == 2 and "give at least one prompt length" in res.output


def test_the_address_served_is_written_as_a_url(caplog):
    from mlxmtp.commands.serve import _run

    caplog.set_level(logging.INFO, logger="mlxmtp")
    with mock.patch(RUN):
        _run(None, "::1", 8080, "info", 1.0)
        _run(None, "127.0.0.1", 8081, "info", 1.0)
    assert "serving on http://[::1]:8080/v1" in caplog.text and "http://127.0.0.1:8081/v1" in caplog.text


def test_a_head_an_interrupted_repair_left_aside_is_pointed_at(repaired, tmp_path):
    model, hf = repaired
    shutil.copytree(model, tmp_path / "m")
    (tmp_path / "m" / "mtp").rename(tmp_path / "m" / ".mtp-old-999999999")  # as a run killed mid-swap leaves it
    res = CliRunner().invoke(main, ["generate", "--model", str(tmp_path / "m"), "-p", "x", "-m", "2", "--enable-mtp"])
    assert res.exit_code == 1, res.output
    assert "an interrupted mlxmtp add-mtp-weights left the head in" in res.output and ".mtp-old-999999999" in res.output
    res = CliRunner().invoke(main, ["add-mtp-weights", "--model", str(tmp_path / "m"), "--source", str(hf)])
    assert res.exit_code == 0 and "restored the previous head" in res.output, res.output
    res = CliRunner().invoke(main, ["generate", "--model", str(tmp_path / "m"), "-p", "x", "-m", "2", "--enable-mtp",
                                    "--json"])
    assert res.exit_code == 0 and json.loads(res.output.strip().splitlines()[-1])["stats"]["mtp_active"]
