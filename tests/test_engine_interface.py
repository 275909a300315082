"""The engine the server calls (engine/interface.Engine) is declared, not probed: the
engine of a process alone and rank 0's driver of a distributed run both have every member
it declares, with the same parameters, and the distributed driver is built the way every
engine is (engine/build.py), with its rank's coordinator."""

import inspect
from typing import get_type_hints
from unittest import mock

import pytest

from mlxmtp.distributed.coordinator import RankCoordinator
from mlxmtp.distributed.engine import DistributedEngine
from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.build import build_engine
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.coordinator import Coordinator
from mlxmtp.engine.interface import Engine

DATA = set(get_type_hints(Engine))  # the declared attributes, their types resolved
METHODS = {name for name, value in vars(Engine).items()
           if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def test_the_interface_declares_what_the_server_calls():
    assert {"prefix_cache", "memory", "cycles", "last_depth", "why"} <= DATA
    assert {"submit", "cancel", "step", "has_work", "num_active", "num_waiting", "calibrate", "close",
            "unstarted_request_ids", "cancelled_ids", "set_fatal_handler"} <= METHODS


def _parameters(cls, name):
    member = inspect.getattr_static(cls, name)
    if isinstance(member, property):
        return "property"
    return list(inspect.signature(member).parameters)


@pytest.mark.parametrize("cls", [BatchGenerator, DistributedEngine], ids=lambda c: c.__name__)
def test_both_engines_have_every_method_of_the_interface(cls):
    for name in METHODS:
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
        assert _parameters(cls, name) == _parameters(Engine, name), f"{cls.__name__}.{name}"


def test_the_distributed_driver_has_every_attribute_as_a_property():
    for name in DATA:
        assert isinstance(inspect.getattr_static(DistributedEngine, name), property), name


def test_the_engine_has_every_attribute_once_built(server_model):
    model, tok = server_model
    engine = build_engine(model, tok, EngineConfig(num_draft=2))
    assert isinstance(engine, BatchGenerator) and type(engine.coordinator) is Coordinator
    missing = [name for name in DATA if not hasattr(engine, name)]
    assert not missing
    engine.set_fatal_handler(lambda message: None)  # nothing: it is rebuilt instead
    engine.close()


def test_a_rank_s_engine_is_built_with_its_coordinator_s_answers(server_model):
    """The policy, the prefix cache and the memory guard get the coordinator's answers when
    they are built: nothing replaces them afterwards."""
    model, tok = server_model
    channel = mock.Mock(leader=True, rank=0)
    channel.share_ints.side_effect = lambda values, n: values  # rank 0 alone: its own sizes
    with mock.patch("mlxmtp.distributed.engine.Channel", return_value=channel):
        driver = DistributedEngine(model, tok, EngineConfig(num_draft=2, prefix_cache_bytes=1 << 20,
                                                            memory_bytes=1 << 30), group=object())
    coordinator = driver.coordinator
    assert isinstance(coordinator, RankCoordinator) and driver.engine.coordinator is coordinator
    assert driver.engine.policy is coordinator.shared and coordinator.shared.inner.fixed == 2
    assert driver.prefix_cache.agree == coordinator.agree and driver.prefix_cache.max_bytes == 1 << 20
    assert driver.memory.budget == 1 << 30 and driver.prefix_cache.room == driver.memory.room.left
    # prefix cache bytes, then the memory guard's per-position and per-row bytes and budget
    assert channel.share_ints.call_count == 4
