"""The `mlxmtp` command line: version, generate's text and JSON output."""

import json

import pytest
from click.testing import CliRunner
from engine_helpers import loaded, reference_greedy

from mlxmtp import __version__
from mlxmtp.cli import main as cli


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
