"""The `mlxmtp` command line: version, generate's text and JSON output."""

import json

import pytest
from click.testing import CliRunner
from engine_helpers import loaded, reference_greedy

from mlxmtp import __version__
from mlxmtp.commands.main import main as cli


def test_version():
    res = CliRunner().invoke(cli, ["--version"])
    assert res.exit_code == 0 and __version__ in res.output


def test_generate_json_matches_mlx_lm(fixture_model):
    path = str(fixture_model("qwen3_next")["hf"])
    res = CliRunner().invoke(cli, ["generate", "--model", path, "--prompt", "def f(x):", "--no-chat-template",
                                   "--max-tokens", "40", "--num-draft", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert set(out) >= {"text", "prompt_tokens", "token_ids", "finish_reason", "stats"}
    assert set(out["stats"]) >= {"drafted", "accepted", "acceptance_by_position", "tokens_per_forward",
                                 "tokens_per_second"}
    model, tok, ref = loaded(path)
    ids = tok.encode("def f(x):")
    assert out["prompt_tokens"] == len(ids)
    assert out["token_ids"] == reference_greedy(ref, ids, 40)
    assert out["finish_reason"] == "length" and out["stats"]["drafted"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--num-draft", "3", "--pipeline-drafts"], ["--pipeline-drafts"],
                                   ["--num-draft", "3", "--compile-steps"]])
def test_generate_with_experimental_cycles_matches_mlx_lm(fixture_model, flags):
    path = str(fixture_model("qwen3_5")["hf"])
    res = CliRunner().invoke(cli, ["generate", "--model", path, "--prompt", "def g(y):", "--no-chat-template",
                                   "--max-tokens", "30", "--json", *flags])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    model, tok, ref = loaded(path)
    assert out["token_ids"] == reference_greedy(ref, tok.encode("def g(y):"), 30)


def test_generate_text_and_bad_parameters(fixture_model):
    path = str(fixture_model("qwen3_5")["hf"])
    res = CliRunner().invoke(cli, ["generate", "--model", path, "--prompt", "hello", "-m", "8", "--temp", "0.7",
                                   "--seed", "1", "--profile"])
    assert res.exit_code == 0, res.output
    assert "Generation: 8 tokens" in res.output and "MTP:" in res.output
    bad = CliRunner().invoke(cli, ["generate", "--model", path, "--prompt", "x", "--top-p", "1.5"])
    assert bad.exit_code != 0 and "top-p" in bad.output


def test_every_command_takes_the_demo_by_its_served_name(tmp_path):
    """`mlxmtp-demo` names the packaged demo in every command that takes a model, and
    inspect / draft-vocab default to it as serve, generate and bench do."""
    from mlxmtp.models import demo

    run = CliRunner().invoke
    for args in (["inspect", "--json"], ["inspect", "mlxmtp-demo", "--json"]):
        res = run(cli, args)
        assert res.exit_code == 0, res.output
        info = json.loads(res.output)
        assert info["path"] == str(demo.PACKAGED) and info["mtp"]["present"]
    res = run(cli, ["generate", "--model", "mlxmtp-demo", "-p", "def f(x):", "--no-chat-template", "-m", "4",
                    "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip().splitlines()[-1])["stats"]["mtp_active"]
    res = run(cli, ["bench", "--model", "mlxmtp-demo", "-p", "8", "-g", "2", "--depths", "", "--no-mlx-lm", "-n", "1",
                    "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["mtp_active"]
    corpus = tmp_path / "code.py"
    corpus.write_text("def f(x):\n    return x + 1\n" * 20)
    for model in ([], ["--model", "mlxmtp-demo"]):
        res = run(cli, ["draft-vocab", *model, "--corpus", str(corpus), "--size", "64", "--out", str(tmp_path / "l.json")])
        assert res.exit_code == 0 and "wrote" in res.output, res.output
        # Never into the package's own folder.
        res = run(cli, ["draft-vocab", *model, "--corpus", str(corpus), "--size", "64"])
        assert res.exit_code == 2 and "give --out PATH" in res.output, res.output
    assert not (demo.PACKAGED / "mtp" / "draft_vocab.json").exists()
    res = run(cli, ["add-mtp-weights", "--model", "mlxmtp-demo", "--source", "mlxmtp-demo"])
    assert res.exit_code == 0 and "already has an MTP head" in res.output, res.output
    res = run(cli, ["add-mtp-weights", "--model", "mlxmtp-demo", "--source", "mlxmtp-demo", "--force"])
    assert res.exit_code == 2 and "repair a copy of it" in res.output, res.output


def test_a_folder_called_mlxmtp_demo_is_taken_as_a_folder(tmp_path, monkeypatch, fixture_model):
    import shutil

    from mlxmtp.models import demo

    monkeypatch.chdir(tmp_path)
    assert demo.resolve("mlxmtp-demo") == str(demo.PACKAGED) and demo.names_demo(None)
    shutil.copytree(fixture_model("qwen3_5")["hf"], tmp_path / "mlxmtp-demo")
    assert demo.resolve("mlxmtp-demo") == "mlxmtp-demo" and not demo.names_demo("mlxmtp-demo")
    res = CliRunner().invoke(cli, ["inspect", "mlxmtp-demo", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["path"] == "mlxmtp-demo", res.output
    assert demo.names_demo(str(demo.PACKAGED))  # the packaged folder by its path


def test_generate_on_a_model_without_a_head_names_generate_s_own_options(fixture_model):
    # MTP is on by default in generate: "drop --enable-mtp" named an option never typed.
    path = str(fixture_model("qwen3_5")["mlx_4bit"])
    res = CliRunner().invoke(cli, ["generate", "--model", path, "-p", "x", "-m", "2"])
    assert res.exit_code == 1 and "no MTP head" in res.output, res.output
    assert "mlxmtp add-mtp-weights" in res.output and "--enable-mtp" not in res.output
    assert "Or generate without MTP: add --disable-mtp, or --mtp-fallback" in res.output
