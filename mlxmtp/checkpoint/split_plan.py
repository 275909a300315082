"""How a model is split over the ranks of a distributed run, read from the folder alone (configs and safetensors
headers; no weight is loaded): what `mlxmtp inspect --ranks N --json` prints, what
loading reads on each rank, and what `generate --json` reports as `stats.distributed`.

The split is a pipeline split (why: docs/across-machines.md): rank r holds `split[r]` consecutive
decoder layers, in mlx-lm's order (the last rank the first layers, rank 0 the last), and
every rank holds what all of them run: the embeddings, the final norm, the lm_head and
the MTP head (one decoder layer), so every rank computes the same logits and drafts.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List

from . import mtp_folder, tensor_files

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_UNUSED = ("vision_tower", "model.visual", "visual.")  # the vision tower: text decoding never loads it


@dataclass
class RankShare:
    rank: int
    layers: List[int]  # [start, end) in the model's layer numbering
    files: List[str]  # the weight files this rank reads
    bytes: int  # weights this rank holds: its layers, the shared tensors and the MTP head


@dataclass
class Plan:
    split: str  # "pipeline"
    ranks: List[RankShare]
    num_layers: int
    shared_bytes: int  # embeddings, final norm, lm_head: on every rank
    head_bytes: int  # the MTP head: on every rank
    total_bytes: int  # the whole checkpoint as one process holds it
    layer_bytes: List[int] = field(default_factory=list)  # per decoder layer

    def share(self, rank: int) -> RankShare:
        return self.ranks[rank]

    def counts(self) -> List[int]:
        """Layers per rank, as mlx-lm's pipeline takes them."""
        return [r.layers[1] - r.layers[0] for r in self.ranks]

    def as_dict(self) -> dict:
        return asdict(self)


def layer_split(num_layers: int, size: int) -> List[int]:
    """Layers per rank: as even as possible, the low ranks taking the extra ones (mlx-lm's
    default; with its order, rank 0, which also serves HTTP, then runs the last layers)."""
    if size > num_layers:
        raise ValueError(f"{size} ranks for a model of {num_layers} layers: at most one rank per layer")
    base, extra = divmod(num_layers, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def _tensors(model_dir: Path) -> Dict[str, tuple]:
    """name -> (file, bytes) for every tensor of the folder's own weight files: the files
    from the safetensors index when there is one, the bytes from the headers of the files
    present (0 for a file not fetched: a rank of a Hugging Face download has its own only)."""
    index = model_dir / "model.safetensors.index.json"
    files = json.loads(index.read_text())["weight_map"] if index.exists() else {}
    out = {name: (file, 0) for name, file in files.items()}
    for path in sorted(model_dir.glob("*.safetensors")):
        out.update({name: (path.name, nbytes) for name, nbytes in _tensor_bytes(path).items()})
    return out


def _tensor_bytes(path: Path) -> Dict[str, int]:
    """name -> bytes of every tensor of one safetensors file, from its header."""
    header, _ = tensor_files.read_header(path)
    return {name: meta["data_offsets"][1] - meta["data_offsets"][0] for name, meta in header.items()}


def _head_bytes(model_dir: Path) -> int:
    weights = model_dir / mtp_folder.FOLDER / mtp_folder.WEIGHTS
    return sum(_tensor_bytes(weights).values()) if weights.exists() else 0


def make_plan(model_dir: Path, size: int) -> Plan:
    """The pipeline plan of the folder for `size` ranks, layers split as evenly as possible."""
    model_dir = Path(model_dir)
    num_layers = _text_config(json.loads((model_dir / "config.json").read_text()))["num_hidden_layers"]
    split = layer_split(num_layers, size)
    layer_bytes = [0] * num_layers
    layer_files: List[set] = [set() for _ in range(num_layers)]
    shared_bytes, head_bytes, shared_files = 0, _head_bytes(model_dir), set()
    for name, (file, nbytes) in _tensors(model_dir).items():
        m = _LAYER.search(name)
        if name.startswith("mtp.") or ".mtp." in name:
            head_bytes += nbytes  # an HF checkpoint's head; every rank reads it
            shared_files.add(file)
        elif name.startswith(_UNUSED):
            continue
        elif m is None or int(m.group(1)) >= num_layers:
            shared_bytes += nbytes
            shared_files.add(file)
        else:
            layer_bytes[int(m.group(1))] += nbytes
            layer_files[int(m.group(1))].add(file)
    ranks = []
    for r in range(size):
        start = sum(split[r + 1:])
        end = start + split[r]
        files = shared_files.union(*layer_files[start:end])
        ranks.append(RankShare(r, [start, end], sorted(files),
                               sum(layer_bytes[start:end]) + shared_bytes + head_bytes))
    total = sum(layer_bytes) + shared_bytes + head_bytes
    return Plan("pipeline", ranks, num_layers, shared_bytes, head_bytes, total, layer_bytes)
