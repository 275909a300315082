"""Loading on one rank of a distributed run: check that every rank has the same model and
settings, plan the split, fetch (from the Hub) and read only this rank's weights."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..checkpoint.split_plan import Plan, make_plan
from ..engine.config import EngineConfig
from ..models import demo
from ..models.load import load
from ..models.model_folder import resolve_model_path
from .channel import Channel
from .group import check_same_setup

log = logging.getLogger("mlxmtp.distributed")


def load_on_rank(group, path_or_hf_id: Optional[str], config: EngineConfig,
                 **load_options) -> Tuple[object, object, Plan]:
    """(MTPModel with this rank's layers, tokenizer, plan); `config`: the engine config this
    rank will build its engine from, checked with `load_options` (which go to models.load)
    to be rank 0's."""
    src = str(demo.resolve(path_or_hf_id))  # the demo: by default, or by its name
    local = Path(src).expanduser().exists()
    config_dir = resolve_model_path(src, weight_files=[])  # configs only, for a Hub id
    check_same_setup(Channel(group), config_dir, config, load_options)
    model_dir, plan = fetch_share(src, config_dir, group.rank(), group.size())
    share = plan.share(group.rank())
    log.info("rank %d of %d: layers %d-%d of %d", group.rank(), group.size(), share.layers[0], share.layers[1] - 1,
             plan.num_layers)
    m, tok = load(str(model_dir), pipeline=(group, plan.counts(), local), **load_options)
    # Wait here, with no timeout, for every rank to have loaded (one may read its share for
    # minutes longer): the engine's collectives that follow run under --dist-timeout.
    mx.eval(mx.distributed.all_sum(mx.array(1), group=group, stream=mx.cpu))
    return m, tok, plan


def fetch_share(src: str, config_dir: Path, rank: int, size: int) -> Tuple[Path, Plan]:
    """(folder, plan) with this rank's weight files in it: a local folder as it is; from
    the Hub (`config_dir`: its configs, fetched already; the plan reads the weight index),
    only the files of this rank's layers and of what every rank holds."""
    plan = make_plan(config_dir, size)
    if Path(src).expanduser().exists():
        return config_dir, plan
    model_dir = resolve_model_path(src, weight_files=plan.share(rank).files)
    return model_dir, make_plan(model_dir, size)


def weight_bytes(model) -> int:
    """Bytes of the weights this process holds: the main model's (its layers) and the head's."""
    total = sum(a.nbytes for _, a in tree_flatten(model.base.parameters()))
    if model.head is not None:
        total += sum(a.nbytes for _, a in tree_flatten(model.head.parameters()))
    return total


def bytes_per_rank(group, model) -> Tuple[List[int], List[int]]:
    """(every rank's `weight_bytes`, every rank's peak MLX memory so far), in rank order
    (a collective: every rank calls it)."""
    mine = np.array([weight_bytes(model), mx.get_peak_memory()], np.int64)
    both = np.array(mx.distributed.all_gather(mx.array(mine), group=group, stream=mx.cpu)).reshape(-1, 2)
    return [int(v) for v in both[:, 0]], [int(v) for v in both[:, 1]]
