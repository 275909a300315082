"""Shared pytest fixtures."""

import pytest

from mlxmtp.testing import fixtures as fx


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
