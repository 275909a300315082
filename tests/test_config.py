"""The config objects the command line makes once (engine/config.py, server/config.py):
an engine option is one EngineConfig field and its use. The distributed start-up check
hashes every field, a field added later included, the object reaches the engine as it
was made, and `serve` builds the same one on rank 0 and on the other ranks."""

import dataclasses
from unittest import mock

import pytest
from click.testing import CliRunner

from mlxmtp.commands.main import main
from mlxmtp.distributed.group import setup_digest
from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.server.app import create_app
from mlxmtp.server.config import SERVED_ENGINE, ServerConfig

RUN = "mlxmtp.server.shutdown.run_server"  # serving itself; mocked so nothing blocks


def _other_value(value):
    """A value of another kind or size than `value`, for any field's type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return "other" if value is None else value + "-other"


def test_the_configs_are_frozen_and_compare_by_value():
    config = EngineConfig(num_draft=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_draft = 3
    assert config == EngineConfig(num_draft=2) and config != EngineConfig(num_draft=3)
    assert EngineConfig() == EngineConfig(max_batch=16, prefix_cache_bytes=0, memory_bytes=0)  # the engine's own
    assert SERVED_ENGINE == EngineConfig(max_batch=8, memory_bytes=None, suffix_drafts=True)  # create_app's, serve's limits
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServerConfig().port = 1


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(EngineConfig)])
def test_every_engine_field_is_in_the_ranks_agreement(field):
    """Two configs differing in one field hash differently: ranks started with it
    different stop at start-up (distributed/group.check_same_setup)."""
    base = EngineConfig()
    changed = dataclasses.replace(base, **{field: _other_value(getattr(base, field))})
    assert setup_digest(changed) != setup_digest(base)
    assert setup_digest(dataclasses.replace(changed)) == setup_digest(changed)  # equal configs agree


def test_the_load_options_are_in_the_ranks_agreement():
    config = EngineConfig(num_draft=2)
    assert setup_digest(config, {"mtp": True}) != setup_digest(config, {"mtp": False})
    one_order, another = {"mtp": True, "draft_vocab": 0}, {"draft_vocab": 0, "mtp": True}
    assert setup_digest(config, one_order) == setup_digest(config, another)


# ------------------------------------------------------------------ a new engine option
# What adding an engine option takes: a field (here added without touching
# engine/config.py) and its use, where the engine reads self.config.
Extended = dataclasses.make_dataclass("Extended", [("new_option", str, dataclasses.field(default="off"))],
                                      bases=(EngineConfig,), frozen=True)


def test_a_new_field_is_in_the_agreement_without_other_edits():
    assert setup_digest(Extended(new_option="on")) != setup_digest(Extended())
    assert setup_digest(Extended(num_draft=2)) != setup_digest(Extended())


def test_a_new_field_reaches_the_engine_without_other_edits(server_model):
    model, tok = server_model
    engine = BatchGenerator(model, tok, Extended(num_draft=2, new_option="on"))
    assert engine.config.new_option == "on" and engine.policy.fixed == 2
    # The server hands the engine factory the config it was given, as rank 0 and every
    # other rank of a distributed server do (commands/serve.py).
    factory = mock.Mock()
    app = create_app(model, tok, ServerConfig(), Extended(max_batch=3, new_option="on"), engine_factory=factory)
    app.state.server.bridge._make_engine()
    assert factory.call_args.args[2] == Extended(max_batch=3, new_option="on")


# ------------------------------------------------------------------ serve on every rank
def _serve_as_rank(rank, model_dir, loaded, args):
    """(the EngineConfig the rank's engine is built from, the config and load options it
    checked against the other ranks) for `serve` on rank `rank` of 2."""
    group = mock.Mock(rank=lambda: rank, size=lambda: 2)
    with mock.patch("mlxmtp.distributed.group.launched_group", return_value=group), \
            mock.patch("mlxmtp.commands.serve._load", return_value=loaded) as load, \
            mock.patch("mlxmtp.distributed.engine.DistributedEngine") as engine, mock.patch(RUN) as run:
        res = CliRunner().invoke(main, ["serve", "--model", str(model_dir), "--port", "0", *args])
        assert res.exit_code == 0, res.output
        if rank == 0:
            run.call_args.args[0].state.server.bridge._make_engine()  # as the engine thread does
    assert engine.call_args.kwargs == {"group": group, "dist_timeout": 7.5}
    return engine.call_args.args[2], load.call_args.args[2], load.call_args.kwargs


def test_serve_builds_the_same_engine_config_on_rank_0_and_the_other_ranks(server_model):
    model, tok = server_model
    args = ["--num-draft", "2", "--decode-concurrency", "3", "--prompt-cache-bytes", "1M", "--prompt-cache-size", "4",
            "--memory-mb", "64", "--prefill-step-size", "64", "--pipeline-drafts", "--dist-timeout", "7.5",
            "--no-suffix-share"]
    built0, checked0, load0 = _serve_as_rank(0, model.model_dir, (model, tok), args)
    built1, checked1, load1 = _serve_as_rank(1, model.model_dir, (model, tok), args)
    assert built0 == built1 and built0 is checked0 and built1 is checked1  # the object every rank hashed
    assert setup_digest(checked0, load0) == setup_digest(checked1, load1)
    assert built0 == EngineConfig(num_draft=2, max_batch=3, prefix_cache_bytes=10**6, prefix_cache_entries=4,
                                  memory_bytes=64 << 20, prefill_step=64, pipeline_drafts=True, suffix_drafts=True,
                                  suffix_share=False)
