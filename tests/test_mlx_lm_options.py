"""mlx-lm's option names (`mlx_lm.server`, `mlx_lm.generate`) on `mlxmtp serve` and
`generate`: the ones with an equivalent do what ours do, --prompt-cache-size bounds the
prefix cache's entries, the tokenizer options reach the tokenizer, and the ones mlxmtp
cannot honour fail before any model loads, saying why."""

import json
from unittest import mock

import pytest
from click.testing import CliRunner
from mlx_lm import tokenizer_utils
from test_prefix_cache import found, put
from transformers import PreTrainedTokenizerBase

from mlxmtp.commands.main import main
from mlxmtp.engine.prefix.cache import PrefixCache
from mlxmtp.models.load import load
from mlxmtp.testing.fixtures import write_hf_checkpoint

RUN = "mlxmtp.server.shutdown.run_server"  # serving itself; mocked so nothing blocks
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{{ '[assistant]' if add_generation_prompt }}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("mlx_lm_options") / "m", "qwen3_5")


@pytest.fixture(scope="module")
def untemplated(tmp_path_factory):
    """A model whose tokenizer has no chat template."""
    path = write_hf_checkpoint(tmp_path_factory.mktemp("untemplated") / "m", "qwen3_5")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def served(*args):
    """The app `serve` would run with these arguments, and its engine."""
    with mock.patch(RUN) as run:
        res = CliRunner().invoke(main, ["serve", "--port", "0", *args])
    assert res.exit_code == 0, res.output
    app = run.call_args.args[0]
    return app, app.state.server.bridge._make_engine()


def generated(*args) -> dict:
    res = CliRunner().invoke(main, ["generate", "--max-tokens", "8", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.output.strip().splitlines()[-1])


# ------------------------------------------------------------------ --prompt-cache-size
def test_a_count_bound_keeps_the_most_recently_used_entries():
    pc = PrefixCache(1 << 20, max_entries=2)
    put(pc, (1,))
    put(pc, (2,))
    assert found(pc, [1, 5]) == (1,)  # (1,) is now the most recently used
    put(pc, (3,))  # a third entry: the least recently used, (2,), leaves
    assert list(pc.entries) == [(1,), (3,)] and pc.bytes == 20
    assert found(pc, [2]) is None and found(pc, [1, 1]) == (1,)
    put(pc, (4, 5))
    assert list(pc.entries) == [(1,), (4, 5)] and found(pc, [3, 3]) is None
    unbounded = PrefixCache(1 << 20)  # the default: bytes alone
    for t in range(20):
        put(unbounded, (t,))
    assert len(unbounded.entries) == 20


def test_prompt_cache_size_and_decode_concurrency_reach_the_engine(model_dir):
    app, engine = served("--model", str(model_dir), "--prompt-cache-size", "3", "--decode-concurrency", "3",
                         "--num-draft-tokens", "2", "--pipeline")
    assert engine.prefix_cache.max_entries == 3 and engine.max_batch == 3 and engine.policy.fixed == 2
    app, engine = served("--model", str(model_dir))
    assert engine.prefix_cache.max_entries is None and engine.max_batch == 8 and engine.policy.fixed is None


# ------------------------------------------------------------------ --prompt-cache-bytes
def test_prompt_cache_bytes_is_the_prefix_cache_s_budget_in_bytes(model_dir):
    """--prefix-cache-mb counts MiB (2**20 bytes); mlx-lm's sizes count M as 10**6."""
    budgets = {}
    for args in (["--prefix-cache-mb", "1"], ["--prompt-cache-bytes", "1048576"], ["--prompt-cache-bytes", "1M"],
                 ["--prompt-cache-bytes", "0.5GB"], ["--prompt-cache-bytes", "0"]):
        budgets[" ".join(args)] = served("--model", str(model_dir), *args)[1].prefix_cache.max_bytes
    assert budgets == {"--prefix-cache-mb 1": 2**20, "--prompt-cache-bytes 1048576": 2**20,
                       "--prompt-cache-bytes 1M": 10**6, "--prompt-cache-bytes 0.5GB": 5 * 10**8,
                       "--prompt-cache-bytes 0": 0}


def test_a_distributed_server_s_ranks_get_the_same_prefix_cache_settings(model_dir):
    """Ranks > 0 build their engine from the config every rank is checked to share."""
    loaded = load(str(model_dir))
    rank1 = mock.Mock(rank=lambda: 1, size=lambda: 2)
    with mock.patch("mlxmtp.distributed.group.launched_group", return_value=rank1), \
            mock.patch("mlxmtp.commands.serve._load", return_value=loaded) as _load, \
            mock.patch("mlxmtp.distributed.engine.DistributedEngine") as engine:
        res = CliRunner().invoke(main, ["serve", "--model", str(model_dir), "--prompt-cache-bytes", "1M",
                                        "--prompt-cache-size", "4", "--decode-concurrency", "2"])
    assert res.exit_code == 0, res.output
    config = _load.call_args.args[2]  # what check_same_setup compares across the ranks
    assert (config.prefix_cache_bytes, config.prefix_cache_entries, config.max_batch) == (10**6, 4, 2)
    assert engine.return_value.follow.called  # rank 1 followed rank 0 with the engine built here
    assert engine.call_args.args[2] is config


# ------------------------------------------------------------------ --num-draft-tokens
def test_num_draft_tokens_pins_generate_s_depth(model_dir):
    pinned = generated("--model", str(model_dir), "-p", "hello", "--num-draft-tokens", "2")["stats"]
    assert pinned["depth_reasons"] == {"fixed": 8} and len(pinned["acceptance_by_position"]) == 2
    assert max(int(d) for d in pinned["depths"]) == 2
    same = generated("--model", str(model_dir), "-p", "hello", "--num-draft", "2")["stats"]
    assert same["depths"] == pinned["depths"]
    adaptive = generated("--model", str(model_dir), "-p", "hello")["stats"]
    assert "fixed" not in adaptive["depth_reasons"]


# ------------------------------------------------------------------ tokenizer options
def test_trust_remote_code_reaches_the_tokenizer(model_dir, monkeypatch):
    seen = []
    original = tokenizer_utils.AutoTokenizer.from_pretrained

    def spy(path, **kwargs):
        seen.append(kwargs)
        return original(path, **kwargs)

    monkeypatch.setattr(tokenizer_utils.AutoTokenizer, "from_pretrained", spy)
    served("--model", str(model_dir), "--trust-remote-code", "--chat-template", TEMPLATE)
    assert seen[-1] == {"trust_remote_code": True, "chat_template": TEMPLATE}
    served("--model", str(model_dir))
    assert seen[-1] == {}
    generated("--model", str(model_dir), "-p", "hi", "--trust-remote-code")
    assert seen[-1] == {"trust_remote_code": True}


def test_use_default_chat_template_needs_a_default(untemplated):
    app, _ = served("--model", str(untemplated))
    assert app.state.server.tok.chat_template is None
    for command in (["serve", "--port", "0"], ["generate", "-p", "hi"]):
        with mock.patch(RUN) as run:
            res = CliRunner().invoke(main, [*command, "--model", str(untemplated), "--use-default-chat-template"])
        assert res.exit_code == 1 and "Traceback" not in res.output, res.output
        assert res.output.strip().splitlines() == [
            f"Error: the tokenizer in {untemplated} has no chat template and no default_chat_template for "
            "--use-default-chat-template (transformers no longer gives tokenizers one): give a template with "
            "serve's --chat-template, or leave the option out"]
        run.assert_not_called()


def test_use_default_chat_template_takes_the_tokenizer_s_default(untemplated, model_dir, monkeypatch):
    monkeypatch.setattr(PreTrainedTokenizerBase, "default_chat_template", TEMPLATE, raising=False)
    tok = served("--model", str(untemplated), "--use-default-chat-template")[0].state.server.tok
    assert tok.chat_template == TEMPLATE and tok.has_chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "[user] hi\n[assistant]"
    # generate renders its prompt with it (without the option: the raw prompt).
    plain = generated("--model", str(untemplated), "-p", "hi")["prompt_tokens"]
    templated = generated("--model", str(untemplated), "-p", "hi", "--use-default-chat-template")["prompt_tokens"]
    assert templated == len(tok.encode(text, add_special_tokens=False)) > plain
    # A template of the model's own, or --chat-template's, wins over the default.
    own = served("--model", str(model_dir), "--use-default-chat-template")[0].state.server.tok
    assert own.chat_template not in (None, TEMPLATE)
    other = "{% for m in messages %}{{ m.content }}{% endfor %}"
    given = served("--model", str(untemplated), "--use-default-chat-template", "--chat-template", other)
    assert given[0].state.server.tok.chat_template == other


# ------------------------------------------------------------------ refused options
REFUSED = [
    (["--draft-model", "mlx-community/Qwen3-0.6B-4bit"], "drafts with the model's own MTP head"),
    (["--kv-bits", "4"], "keeps its caches unquantized"),
    (["--kv-group-size", "64"], "keeps its caches unquantized"),
    (["--quantized-kv-start", "0"], "keeps its caches unquantized"),
]


@pytest.mark.parametrize("command, args, why", [("serve", *case) for case in REFUSED]
                         + [("generate", *case) for case in REFUSED])
def test_mlx_lm_options_without_an_equivalent_are_refused_before_loading(command, args, why):
    extra = ["-p", "x"] if command == "generate" else []
    with mock.patch("mlxmtp.models.load.load") as load_model, mock.patch(RUN) as run:
        res = CliRunner().invoke(main, [command, *extra, *args])
    assert res.exit_code == 2, res.output
    assert f"Error: {args[0]} is not supported: " in res.output and why in " ".join(res.output.split())
    load_model.assert_not_called()
    run.assert_not_called()


def test_prompt_concurrency_is_taken_and_ignored_with_a_warning():
    with mock.patch(RUN) as run:
        res = CliRunner().invoke(main, ["serve", "--prompt-concurrency", "8"])
    assert res.exit_code == 0, res.output
    assert "Warning: --prompt-concurrency is ignored: mlxmtp prefills one prompt at a time" in res.output
    run.assert_called_once()
    with mock.patch(RUN) as run:
        assert CliRunner().invoke(main, ["serve", "--prompt-concurrency", "0"]).exit_code == 2
    run.assert_not_called()


def test_the_help_names_the_mlx_lm_options():
    text = " ".join(CliRunner().invoke(main, ["serve", "--help"]).output.split())
    for name in ("--num-draft-tokens", "--decode-concurrency", "--prompt-cache-bytes", "--prompt-cache-size",
                 "--trust-remote-code", "--use-default-chat-template", "--pipeline"):
        assert name in text
    assert "--pipeline Accepted for mlx_lm.server and ignored" in text
    assert "--kv-bits" not in text and "--draft-model" not in text  # refused: hidden
