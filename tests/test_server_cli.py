"""`mlxmtp serve` CLI paths that must not block on serving."""

import json
import logging
import os
from unittest import mock

import pytest
from click.testing import CliRunner

from mlxmtp.commands.main import main
from mlxmtp.engine.limits import MAX_DRAFT_DEPTH
from mlxmtp.engine.prefix.cache import default_budget
from mlxmtp.testing.fixtures import write_hf_checkpoint

RUN = "mlxmtp.server.shutdown.run_server"  # serving itself; mocked so nothing blocks


def test_enable_mtp_without_head_is_a_clear_error(tmp_path):
    path = write_hf_checkpoint(tmp_path / "nohead", "qwen3_5", with_mtp=False)
    with mock.patch(RUN) as run:
        res = CliRunner().invoke(main, ["serve", "--model", str(path), "--enable-mtp"])
    assert res.exit_code != 0
    assert "mlxmtp add-mtp-weights" in res.output
    assert "no MTP head" in res.output
    assert "Or serve without MTP: drop --enable-mtp, or add --mtp-fallback." in res.output
    run.assert_not_called()


def test_fallback_and_default_serve_without_head(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mlxmtp")
    path = write_hf_checkpoint(tmp_path / "nohead", "qwen3_5", with_mtp=False)
    for extra in (["--enable-mtp", "--mtp-fallback"], []):
        with mock.patch(RUN) as run:
            res = CliRunner().invoke(main, ["serve", "--model", str(path), "--port", "0", *extra])
        assert res.exit_code == 0, res.output
        app = run.call_args.args[0]
        assert run.call_args.kwargs["host"] == "127.0.0.1"
        state = app.state.server
        assert not state.mtp_active and "add-mtp-weights" in state.mtp_disabled_reason
    # Startup logs name the model and say why the head is inactive.
    assert f"model: {path}" in caplog.text and "MTP head: inactive" in caplog.text
    assert "no MTP head" in caplog.text


def test_serve_options_reach_the_app(tmp_path):
    path = write_hf_checkpoint(tmp_path / "m", "qwen3_5")
    with mock.patch(RUN) as run:
        res = CliRunner().invoke(main, ["serve", "--model", str(path), "--port", "9999", "--api-key", "k",
                                        "--max-prompt-tokens", "100", "--num-draft", "2", "--log-level", "warning",
                                        "--context-length", "777", "--max-body-mb", "0.5",
                                        "--shutdown-timeout", "3.5", "--strict-model-name", "--alias", "a1"])
    assert res.exit_code == 0, res.output
    app = run.call_args.args[0]
    assert run.call_args.kwargs["port"] == 9999
    assert run.call_args.kwargs["shutdown_timeout"] == 3.5
    assert app.api_key == "k" and app.max_body == 2**19
    state = app.state.server
    assert state.mtp_active and state.max_prompt_tokens == 100 and state.model_id == str(path)
    assert state.context_length == 777
    assert state.strict_model_name and state.knows_model("m")  # a local path also answers to its folder name
    assert state.knows_model("a1") and not state.knows_model("claude-x")


def test_the_default_prefix_cache_budget_leaves_room_for_the_model():
    """A quarter of the device's memory, and at most half of what the weights leave."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with mock.patch("mlx.core.device_info", return_value={"device_name": "cpu"}):
        assert default_budget() == physical // 4
    with mock.patch("mlx.core.device_info", return_value={"memory_size": 128 << 30}):
        assert default_budget(54 << 30) == 32 << 30  # a bf16 27B model
        assert default_budget(110 << 30) == 9 << 30  # one that nearly fills the machine
        assert default_budget(130 << 30) == 0


def test_the_served_model_s_weights_reach_the_default_budget(tmp_path):
    from mlxmtp.engine import budgets
    from mlxmtp.engine.config import EngineConfig
    from mlxmtp.models.load import load

    model, _ = load(str(write_hf_checkpoint(tmp_path / "m", "qwen3_5")))
    weights = budgets.weight_bytes(model)
    assert weights > 0
    with mock.patch("mlx.core.device_info", return_value={"memory_size": weights * 6 // 5}):
        config = budgets.resolved(model, EngineConfig(prefix_cache_bytes=None))
    assert config.prefix_cache_bytes == (weights * 6 // 5 - weights) // 2


def test_serve_defaults(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mlxmtp")
    path = write_hf_checkpoint(tmp_path / "m", "qwen3_5")
    with mock.patch(RUN) as run:
        res = CliRunner().invoke(main, ["serve", "--model", str(path)], env={"MLXMTP_API_KEY": None})
    assert res.exit_code == 0, res.output
    assert f"prefix cache: up to {default_budget() >> 20} MiB" in caplog.text  # the fixture's weights are tiny
    with mock.patch(RUN):
        res = CliRunner().invoke(main, ["serve", "--model", str(path), "--prefix-cache-mb", "5"])
    assert res.exit_code == 0 and "prefix cache: up to 5 MiB" in caplog.text
    app = run.call_args.args[0]
    assert run.call_args.kwargs["shutdown_timeout"] == 10.0 and run.call_args.kwargs["host"] == "127.0.0.1"
    assert app.api_key is None and app.max_body == 8 * 2**20
    assert app.state.server.context_length == 4096  # the fixture's max_position_embeddings
    assert not app.state.server.strict_model_name and app.state.server.knows_model("claude-sonnet-4-5")


@pytest.mark.parametrize("args,env,where", [
    (["--api-key", ""], {}, "--api-key"),
    (["--api-key", "   "], {}, "--api-key"),
    ([], {"MLXMTP_API_KEY": ""}, "MLXMTP_API_KEY"),
    ([], {"MLXMTP_API_KEY": " \t"}, "MLXMTP_API_KEY"),
])
def test_empty_api_key_is_refused_before_loading(args, env, where):
    # An empty key used to turn authentication off silently.
    with mock.patch("mlxmtp.models.load.load") as load, mock.patch(RUN) as run:
        res = CliRunner().invoke(main, ["serve", *args], env=env)
    assert res.exit_code == 2, res.output
    assert "API key is empty" in res.output and where in res.output
    load.assert_not_called()
    run.assert_not_called()


def test_num_draft_bound_and_help():
    res = CliRunner().invoke(main, ["serve", "--num-draft", str(MAX_DRAFT_DEPTH + 1)])
    assert res.exit_code == 2 and "--num-draft" in res.output
    res = CliRunner().invoke(main, ["generate", "-p", "x", "--num-draft", str(MAX_DRAFT_DEPTH + 1)])
    assert res.exit_code == 2 and "--num-draft" in res.output
    res = CliRunner().invoke(main, ["serve", "--help"])
    assert res.exit_code == 0
    text = " ".join(res.output.split())
    assert "--shutdown-timeout" in text and "--context-length" in text and "--max-body-mb" in text
    assert "longer prompts with 400" in text


def test_unset_sampling_fields_take_the_model_s_recommendation_then_the_options(tmp_path):
    # Qwen3.5/3.6 ship do_sample with temperature / top_p / top_k (as the fixtures do) and
    # warn against greedy decoding; agents (Claude Code) send no temperature. The demo
    # model's generation_config does not sample: greedy.
    path = write_hf_checkpoint(tmp_path / "m", "qwen3_5")
    qwen = json.loads((path / "generation_config.json").read_text())
    ids = {k: qwen[k] for k in ("bos_token_id", "pad_token_id", "eos_token_id")}
    served = {}
    for name, config, options in [
        ("qwen", qwen, []),
        ("qwen + options", qwen, ["--temp", "0.2", "--min-p", "0.1"]),
        ("no sampling", dict(ids, do_sample=False, temperature=0.6), []),
        ("no sampling + option", dict(ids), ["--top-k", "40"]),
        ("sampling, no temperature", dict(ids, do_sample=True, top_p=0.8, top_k=-1), []),
    ]:
        (path / "generation_config.json").write_text(json.dumps(config))
        with mock.patch(RUN) as run:
            res = CliRunner().invoke(main, ["serve", "--model", str(path), *options])
        assert res.exit_code == 0, res.output
        served[name] = run.call_args.args[0].state.server.sampling_defaults
    assert served == {
        "qwen": {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
        "qwen + options": {"temperature": 0.2, "top_p": 0.95, "top_k": 20, "min_p": 0.1},
        "no sampling": {},
        "no sampling + option": {"top_k": 40},
        "sampling, no temperature": {"temperature": 1.0, "top_p": 0.8},  # top_k -1 is not a valid value
    }


def test_a_request_s_own_sampling_fields_win_over_the_defaults():
    from mlxmtp.server.validation import sampling_params

    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    p = sampling_params({}, 320, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.6, 0.95, 20, 0.0)
    p = sampling_params({"temperature": 0, "top_k": 5}, 320, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 0.95, 5)
    assert sampling_params({}, 320, anthropic=True, defaults={"temperature": 1.5}).temperature == 1.5
    assert sampling_params({}, 16, defaults={"top_k": 20}).top_k == 15  # never beyond the vocabulary
    p = sampling_params({}, 320)
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 1.0, 0)


def test_a_port_in_use_is_refused_before_the_model_loads(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with mock.patch("mlxmtp.commands.serve._load") as load, mock.patch(RUN) as run:
            res = CliRunner().invoke(main, ["serve", "--port", str(port)])
    assert res.exit_code != 0 and f"cannot listen on 127.0.0.1:{port}" in res.output
    load.assert_not_called()
    run.assert_not_called()


SERVE_ON = """
import sys
from mlxmtp.models.load import load
from mlxmtp.server.app import create_app
from mlxmtp.server.shutdown import run_server
model, tok = load(sys.argv[1])
run_server(create_app(model, tok), host="127.0.0.1", port=int(sys.argv[2]), log_level="info", shutdown_timeout=1)
"""


@pytest.mark.slow
def test_serving_that_cannot_bind_stops_the_engine_and_exits_with_uvicorn_s_code(tmp_path):
    # The port is taken between the check and the bind: uvicorn's startup failure (3), not
    # an abort in the interpreter's teardown while the engine thread runs.
    import socket
    import subprocess
    import sys

    path = write_hf_checkpoint(tmp_path / "m", "qwen3_5")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        res = subprocess.run([sys.executable, "-c", SERVE_ON, str(path), str(taken.getsockname()[1])],
                             capture_output=True, text=True, timeout=300)
    assert res.returncode == 3, res.stderr[-2000:]
    assert "address already in use" in res.stderr.lower() and "terminate called" not in res.stderr


def test_chat_template_options_reach_the_app(tmp_path):
    path = write_hf_checkpoint(tmp_path / "m", "qwen3_5")
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ '<go>' if add_generation_prompt }}"
    (tmp_path / "t.jinja").write_text(template)
    for value in (str(tmp_path / "t.jinja"), template):
        with mock.patch(RUN) as run:
            res = CliRunner().invoke(main, ["serve", "--model", str(path), "--chat-template", value,
                                            "--chat-template-args", '{"enable_thinking": false, "x": 1}'])
        assert res.exit_code == 0, res.output
        state = run.call_args.args[0].state.server
        assert state.tok.chat_template == template
        assert state.chat_template_args == {"enable_thinking": False, "x": 1}
        assert state.tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True) == "<user>hi<go>"


def test_a_chat_template_that_cannot_render_is_refused_at_start(tmp_path):
    path = write_hf_checkpoint(tmp_path / "m", "qwen3_5")
    (tmp_path / "empty.jinja").write_text("")
    for template, message in [("{% for m in messages %}{{ m.content }", "cannot render a conversation"),
                              ("{{ raise_exception('no') }}", "cannot render a conversation"),
                              (str(tmp_path / "empty.jinja"), "leaves a conversation's messages out"),
                              ("{{ 'constant' }}", "leaves a conversation's messages out")]:
        with mock.patch(RUN) as run:
            res = CliRunner().invoke(main, ["serve", "--model", str(path), "--chat-template", template])
        assert res.exit_code == 1 and message in res.output, res.output
        run.assert_not_called()
    (tmp_path / "latin1.jinja").write_bytes("{{ 'caf\xe9' }}".encode("latin-1"))
    res = CliRunner().invoke(main, ["serve", "--chat-template", str(tmp_path / "latin1.jinja")])
    assert res.exit_code == 2 and "cannot read" in res.output, res.output


@pytest.mark.parametrize("args, message", [
    (["--chat-template", "templates/qwen.jinja"], "neither a file nor a Jinja template"),
    (["--chat-template-args", "{enable_thinking: false}"], "not JSON"),
    (["--chat-template-args", "[1]"], "must be a JSON object"),
    (["--chat-template-args", '{"add_generation_prompt": false}'], "add_generation_prompt: set by the server"),
    (["--chat-template-args", '{"enable_thinking": "no"}'], "enable_thinking must be true or false"),
    (["--allowed-origins", "http://localhost:3000/"], "is not an origin"),
    (["--allowed-origins", "localhost:3000"], "is not an origin"),
    (["--allowed-origins", "ftp://a.example"], "is not an origin"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--prefill-step-size", "8"], "--prefill-step-size"),
    # mlx-lm's names (test_mlx_lm_options.py)
    (["--num-draft-tokens", str(MAX_DRAFT_DEPTH + 1)], "'--num-draft' / '--num-draft-tokens'"),
    (["--decode-concurrency", "0"], "'--max-concurrent' / '--decode-concurrency'"),
    (["--prompt-cache-size", "0"], "--prompt-cache-size"),
    (["--prompt-cache-bytes", "8K"], "Invalid value for --prompt-cache-bytes: '8K' is not a size"),
    (["--prompt-cache-bytes", "-1"], "Invalid value for --prompt-cache-bytes: '-1' is not a size"),
    (["--prompt-cache-bytes", "1M", "--prefix-cache-mb", "1"],
     "--prompt-cache-bytes and --prefix-cache-mb both set the prefix cache's memory"),
])
def test_bad_serve_options_are_refused_before_loading(args, message):
    with mock.patch("mlxmtp.models.load.load") as load, mock.patch(RUN) as run:
        res = CliRunner().invoke(main, ["serve", *args])
    assert res.exit_code == 2 and message in res.output, res.output
    load.assert_not_called()
    run.assert_not_called()


def test_the_demo_s_requests_without_a_limit_get_256_tokens_a_real_model_s_none(tmp_path, caplog):
    # Without a limit the demo wrote to the end of its 4096-token context (two minutes for "hi").
    from mlxmtp.models import demo

    caplog.set_level(logging.INFO, logger="mlxmtp")
    path = write_hf_checkpoint(tmp_path / "m", "qwen3_5")
    served = {}
    for name, args in [("demo", []), ("demo by name", ["--model", "mlxmtp-demo"]),
                       ("demo, --max-tokens", ["--max-tokens", "1000"]), ("real model", ["--model", str(path)])]:
        with mock.patch(RUN) as run:
            res = CliRunner().invoke(main, ["serve", "--port", "0", *args])
        assert res.exit_code == 0, res.output
        state = run.call_args.args[0].state.server
        served[name] = (state.model_id, state.default_max_tokens)
    assert served == {"demo": ("mlxmtp-demo", demo.MAX_TOKENS), "demo by name": ("mlxmtp-demo", 256),
                      "demo, --max-tokens": ("mlxmtp-demo", 1000), "real model": (str(path), None)}
    assert "model: packaged demo model (mlxmtp-demo)" in caplog.text
    assert "sets no max_tokens: up to 256 tokens, the demo model's default" in caplog.text
    assert "sets no max_tokens: up to 1000 tokens (--max-tokens)" in caplog.text
    assert "sets no max_tokens: to the end of its turn or of the context" in caplog.text
    # What bounds one request: the context, not the memory that would hold millions of tokens.
    assert "one request alone: up to 4096 tokens, the context length (memory would hold " in caplog.text
    help_text = " ".join(CliRunner().invoke(main, ["serve", "--help"]).output.split())
    assert "the demo model 256, in every API" in help_text


def test_the_memory_line_says_when_memory_bounds_a_request(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mlxmtp")
    path = write_hf_checkpoint(tmp_path / "m", "qwen3_5")
    with mock.patch(RUN) as run:
        res = CliRunner().invoke(main, ["serve", "--model", str(path), "--memory-mb", "1"])
    assert res.exit_code == 0, res.output
    fits = run.call_args.args[0].state.server.context_length
    assert fits < 4096
    assert f"one request alone: up to {fits} tokens, what its caches can reach in memory" in caplog.text
