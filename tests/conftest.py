"""Shared pytest fixtures."""

import contextlib
import functools
import importlib
import os

import pytest

from mlxmtp.testing import fixtures as fx

# The commands keep what the depth policy learnt in the user's cache (--policy-state-dir):
# a test run neither reads nor leaves such state, so every test's engine starts as a first
# run would (tests of that state name their own folders).
os.environ["MLXMTP_POLICY_STATE_DIR"] = "none"


def _share_ssl_contexts():
    """Every httpx client (httpx.post and httpx.get; the OpenAI and Anthropic clients, on
    httpx2) builds an SSL context and loads a CA bundle into it, though the tests' requests
    all go to 127.0.0.1 over plain http: thousands of them made it a large share of the
    server tests' time (BENCHMARKS.md, "The test suite"). Here the clients share one context
    per setting, as passing `verify=<context>` to each would (a private name: where it is
    gone, each builds its own)."""
    for name in ("httpx._transports.default", "httpx2._transports.default"):
        try:
            transports = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(transports, "create_ssl_context"):
            transports.create_ssl_context = functools.lru_cache(maxsize=8)(transports.create_ssl_context)


_share_ssl_contexts()


@pytest.fixture(scope="session")
def fixture_models(tmp_path_factory):
    """Every variant of ``fx.FAMILIES`` built once per session (about a second):
    ``{name: {"hf": Path, "mlx_4bit": Path, "mlx_8bit": Path}}``."""
    return fx.build_all(tmp_path_factory.mktemp("fixture_models"))


@pytest.fixture(scope="session")
def fixture_model(tmp_path_factory):
    """Lazy, cached per variant: ``fixture_model("qwen3_5")["hf"]``. Cheaper than
    ``fixture_models`` when a test needs one variant only."""
    root = tmp_path_factory.mktemp("fixture_model")
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = fx.build_variant(name, root)
        return cache[name]

    return get


# ------------------------------------------------------------------ servers (server_helpers.py)
@pytest.fixture(scope="module")
def server_model(tmp_path_factory):
    """The float32 qwen3_5 fixture checkpoint, loaded once per test module: (model, tok)."""
    from mlxmtp.models.load import load
    from mlxmtp.testing.fixtures import write_hf_checkpoint

    return load(str(write_hf_checkpoint(tmp_path_factory.mktemp("server_model") / "model", "qwen3_5")))


@pytest.fixture(scope="module")
def start_server(server_model):
    """``start_server(scripts=None, *, hook=None, tok=None, engine=None, **server)``: a
    started ServerThread on ``server_model``, stopped at the end of the module, with the
    ServerConfig of ``server``'s fields and the EngineConfig ``engine`` (None: create_app's
    default, server.config.SERVED_ENGINE; server_helpers.served_engine changes fields of it).
    With ``scripts`` the request hook is a server_helpers.Hook forcing them; ``hook`` gives
    one of the test's own; ``tok`` another tokenizer (template) on the same weights."""
    from server_helpers import Hook, ServerThread

    from mlxmtp.server.app import create_app
    from mlxmtp.server.config import SERVED_ENGINE, ServerConfig

    model, default_tok = server_model
    with contextlib.ExitStack() as stack:

        def start(scripts=None, *, hook=None, tok=None, engine=None, **server):
            tok = tok or default_tok
            if hook is None and scripts is not None:
                hook = Hook(tok, scripts)
            app = create_app(model, tok, ServerConfig(**server), engine or SERVED_ENGINE, request_hook=hook)
            srv = stack.enter_context(ServerThread(app))
            srv.hook = hook
            return srv

        yield start


@pytest.fixture()
def oai(server):
    """An OpenAI client for the module's ``server``."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture()
def ant(server):
    """An Anthropic client for the module's ``server``."""
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): one worker per core, at most four, as each worker holds its
    own MLX runtime, fixture models and servers in memory (`-n 0` runs in one process)."""
    import os

    return max(1, min(4, os.cpu_count() or 1))
