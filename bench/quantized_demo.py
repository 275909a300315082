"""The demo model quantized like mlx-lm's published 4-bit folders, with a head that works.

Random quantized fixtures have heads that never agree with their models, so they only
show the fallback; this one has the demo's trained head. The backbone is quantized by
mlx-lm's own converter (`mlx_lm.convert`, which accepts an MLX folder: sanitize is a
no-op there); the head is quantized with the same `nn.quantize` defaults (every Linear
whose input is a multiple of the group size), which is what `mlxmtp add-mtp-weights`
produces from a BF16 checkpoint, and saved as an `mtp/` folder.

    python bench/quantized_demo.py OUT [--bits 4]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
from pathlib import Path

import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxmtp.checkpoint import mtp_folder
from mlxmtp.models.demo import demo_model_path
from mlxmtp.models.load import load


def quantized_demo(out, bits: int = 4, group_size: int = 64) -> Path:
    from mlx_lm.convert import convert

    out, src = Path(out), demo_model_path()
    if out.exists():
        shutil.rmtree(out)
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(src), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=group_size)
    model, _ = load(str(src))
    head = model.head
    head.set_dtype(model.parts.embed_tokens.weight.dtype)  # the CPU fp32 cast undone: as stored
    nn.quantize(head, group_size=group_size, bits=bits,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0)
    config, _ = mtp_folder.read_mtp_folder(src)
    config = {**config, "source": f"{config['source']} (quantized for bench/quantized_demo.py)",
              "quantization": {"group_size": group_size, "bits": bits}}
    mtp_folder.write_mtp_folder(out, config, dict(tree_flatten(head.parameters())))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--bits", type=int, default=4)
    args = ap.parse_args()
    print(quantized_demo(args.out, args.bits))
