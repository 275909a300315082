"""`mlxmtp serve` CLI paths that must not block on serving."""

import logging
from unittest import mock

from click.testing import CliRunner

from mlxmtp.cli import main
from mlxmtp.testing.fixtures import write_hf_checkpoint


def test_enable_mtp_without_head_is_a_clear_error(tmp_path):
    path = write_hf_checkpoint(tmp_path / "nohead", "qwen3_5", with_mtp=False)
    with mock.patch("uvicorn.run") as run:
        res = CliRunner().invoke(main, ["serve", "--model", str(path), "--enable-mtp"])
    assert res.exit_code != 0
    assert "mlxmtp add-mtp-weights" in res.output
    assert "no MTP head" in res.output
    run.assert_not_called()


def test_fallback_and_default_serve_without_head(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mlxmtp")
    path = write_hf_checkpoint(tmp_path / "nohead", "qwen3_5", with_mtp=False)
    for extra in (["--enable-mtp", "--mtp-fallback"], []):
        with mock.patch("uvicorn.run") as run:
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
    with mock.patch("uvicorn.run") as run:
        res = CliRunner().invoke(main, ["serve", "--model", str(path), "--port", "9999", "--api-key", "k",
                                        "--max-prompt-tokens", "100", "--num-draft", "2", "--log-level", "warning"])
    assert res.exit_code == 0, res.output
    app = run.call_args.args[0]
    assert run.call_args.kwargs["port"] == 9999
    assert app.api_key == "k"
    state = app.state.server
    assert state.mtp_active and state.max_prompt_tokens == 100 and state.model_id == str(path)
    assert state.knows_model("m")  # a local path also answers to its folder name
