"""Safetensors files read by hand: headers without data, and tensors (or ranges of their
first axis) with plain file reads.

Plain reads, not mmap: pages touched through a map count as resident memory, and the
converter promises a bounded footprint (see convert/add_mtp_weights.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

# safetensors dtype -> (numpy dtype of the stored bytes, mlx dtype, mlx dtype name)
ST_DTYPES = {
    "BF16": (np.uint16, mx.bfloat16, "bfloat16"),
    "F16": (np.float16, mx.float16, "float16"),
    "F32": (np.float32, mx.float32, "float32"),
}


class TensorFileError(ValueError):
    """A tensor that is not where its index says, or of a dtype this reader does not take."""


def read_header(path: Path) -> Tuple[Dict[str, dict], int]:
    """(tensor name -> {dtype, shape, data_offsets}, offset where the data starts)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > os.fstat(f.fileno()).st_size - 8:  # a cut or foreign file: never read (allocate) n bytes
            raise ValueError(f"{Path(path).name}: not a safetensors file (header length {n} past its end)")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def itemsize(st_dtype: str) -> int:
    """Bytes per element of a safetensors dtype this reader takes (0 for others)."""
    return np.dtype(ST_DTYPES[st_dtype][0]).itemsize if st_dtype in ST_DTYPES else 0


def nbytes(meta: dict, skip_axes: int = 0) -> int:
    """Bytes of a tensor described by its header entry, without its first `skip_axes` axes."""
    return int(np.prod(meta["shape"][skip_axes:], dtype=np.int64)) * itemsize(meta["dtype"])


class TensorReader:
    """Reads tensors (or expert ranges of them) from the safetensors files of one folder;
    nothing else of a file is loaded. Headers are read once per file."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._headers: Dict[str, Tuple[dict, int]] = {}

    def header(self, shard: str) -> Tuple[dict, int]:
        if shard not in self._headers:
            self._headers[shard] = read_header(self.folder / shard)
        return self._headers[shard]

    def info(self, shard: str, name: str) -> dict:
        header, _ = self.header(shard)
        if name not in header:
            raise TensorFileError(f"{name} is listed in the index under {shard} but is not in that file")
        return header[name]

    def read(self, shard: str, name: str, start: int = 0, stop: Optional[int] = None) -> mx.array:
        """The tensor, or rows start:stop of its first axis, as an mlx array (a copy)."""
        header, base = self.header(shard)
        meta = header[name]
        if meta["dtype"] not in ST_DTYPES:
            raise TensorFileError(f"{name}: unsupported dtype {meta['dtype']}")
        np_dtype, mx_dtype, _ = ST_DTYPES[meta["dtype"]]
        shape = list(meta["shape"])
        stop = shape[0] if stop is None else stop
        row = nbytes(meta, skip_axes=1) if shape else 0
        begin = base + meta["data_offsets"][0]
        with open(self.folder / shard, "rb") as f:
            if shape:
                f.seek(begin + start * row)
                buf = f.read((stop - start) * row)
                arr = np.frombuffer(buf, dtype=np_dtype).reshape([stop - start] + shape[1:])
            else:
                f.seek(begin)
                arr = np.frombuffer(f.read(np.dtype(np_dtype).itemsize), dtype=np_dtype).reshape(())
        out = mx.array(arr)  # copies
        del arr
        return out.view(mx_dtype) if mx_dtype == mx.bfloat16 else out
