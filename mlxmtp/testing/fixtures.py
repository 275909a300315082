"""Tiny random-weight checkpoints in the real Qwen3-Next / Qwen3.5 / Qwen3.6 layouts.

Everything here is written in seconds from a seeded numpy RNG, so tests can
exercise the real loading paths (HF sharded safetensors with an ``mtp.*`` head,
mlx-lm conversions that dropped the head) without downloading a model.

    python -m mlxmtp.testing.fixtures OUTDIR

builds every variant in ``FAMILIES`` (HF fp32 + 4-bit and 8-bit mlx-lm
conversions) into OUTDIR and prints the paths.

The tokenizer, configs and weights are made in `fixture_tokenizer`, `fixture_configs` and
`fixture_weights`; this file writes them out and names the variants (names used by tests
are re-exported here).

Layout facts follow /work/shared/docs/mtp-reference.md and the ``sanitize``
methods of mlx-lm's qwen3_next.py / qwen3_5.py / qwen3_5_moe.py (0.32.x).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import numpy as np

from .fixture_configs import DEFAULT_SIZES, FAMILY_NAMES, make_config, num_mtp_layers, text_config  # noqa: F401
from .fixture_tokenizer import (  # noqa: F401
    _PRETOKENIZE_REGEX,
    ADDED_TOKENS,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    _write_json,
    save_tokenizer,
    token_id,
    tokenizer_size,
    write_tokenizer,
)
from .fixture_weights import make_weights

# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def _assign_shards(names: List[str], sizes: Dict[str, int], num_shards: int) -> List[List[str]]:
    """Main tensors split by bytes in order; the MTP head split between the first
    and the last shard, so code must use the index rather than assume a place."""
    main = [n for n in names if not n.startswith("mtp.")]
    head = [n for n in names if n.startswith("mtp.")]
    shards: List[List[str]] = [[] for _ in range(num_shards)]
    total = sum(sizes[n] for n in main)
    acc = 0
    for n in main:
        shards[min(num_shards - 1, acc * num_shards // max(total, 1))].append(n)
        acc += sizes[n]
    half = (len(head) + 1) // 2
    shards[0].extend(head[:half])
    shards[-1].extend(head[half:])
    return shards


def save_safetensors_shards(
    path: Path,
    weights: Dict[str, np.ndarray],
    *,
    dtype: str = "float32",
    num_shards: int = 3,
    keep_float32: Iterable[str] = ("A_log",),
) -> Dict[str, str]:
    """Write HF-style shards (+ model.safetensors.index.json when sharded) and
    return the weight map. ``num_shards=1`` writes a lone model.safetensors
    without an index, as HF does for small models."""
    import mlx.core as mx

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported dtype {dtype!r}")
    target = getattr(mx, dtype)

    def to_mx(name, a):
        x = mx.array(a)
        # Qwen3.5 checkpoints keep A_log in float32 even when the rest is bf16
        # (mlx-lm's cast_predicate exists for this reason).
        if any(name.endswith(k) for k in keep_float32):
            return x
        return x.astype(target)

    arrays = {k: to_mx(k, v) for k, v in weights.items()}
    sizes = {k: v.nbytes for k, v in arrays.items()}
    if num_shards <= 1:
        files = {"model.safetensors": list(arrays)}
    else:
        groups = _assign_shards(list(arrays), sizes, num_shards)
        files = {
            f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors": g for i, g in enumerate(groups)
        }
    weight_map = {}
    for fname, names in files.items():
        mx.save_safetensors(
            str(path / fname), {n: arrays[n] for n in names}, metadata={"format": "pt"}
        )
        weight_map.update({n: fname for n in names})
    if num_shards > 1:
        _write_json(
            path / "model.safetensors.index.json",
            {
                "metadata": {"total_size": sum(sizes.values())},
                "weight_map": dict(sorted(weight_map.items())),
            },
        )
    return weight_map


def write_generation_config(path: Path) -> None:
    _write_json(
        path / "generation_config.json",
        {
            "bos_token_id": token_id(PAD_TOKEN),
            "pad_token_id": token_id(PAD_TOKEN),
            "do_sample": True,
            "eos_token_id": [token_id(EOS_TOKEN), token_id(PAD_TOKEN)],
            "temperature": 0.6,
            "top_k": 20,
            "top_p": 0.95,
            "transformers_version": "4.57.0",
        },
    )


def write_hf_checkpoint(
    path,
    family: str,
    *,
    dtype: str = "float32",
    tie_word_embeddings: bool = False,
    expert_layout: Optional[str] = None,
    seed: int = 0,
    num_shards: int = 3,
    with_mtp: bool = True,
    **overrides,
) -> Path:
    """Write a tiny HF checkpoint of ``family`` ("qwen3_next", "qwen3_5",
    "qwen3_5_moe") with random weights, an MTP head (unless ``with_mtp`` is
    False; the config field stays), tokenizer and generation_config.

    ``expert_layout`` picks the layout of the MTP experts of the MoE families:
    "per_expert" (Qwen3-Next, Qwen3.5; default) or "fused" (Qwen3.6). ``overrides`` replace config model
    fields, e.g. ``num_hidden_layers=8``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = make_config(family, dtype=dtype, tie_word_embeddings=tie_word_embeddings, **overrides)
    _write_json(path / "config.json", config)
    weights = make_weights(
        family, config, expert_layout=expert_layout, seed=seed, with_mtp=with_mtp
    )
    save_safetensors_shards(path, weights, dtype=dtype, num_shards=num_shards)
    write_tokenizer(path)
    write_generation_config(path)
    return path


def write_mlx_conversion(
    hf_path,
    out_path,
    *,
    bits: Optional[int] = None,
    group_size: int = 64,
    dtype: Optional[str] = None,
) -> Path:
    """Convert with mlx-lm's own converter: the result has no ``mtp.*`` tensors,
    like the MLX repos published for these models.

    Unquantized conversions default to float32 (mlx-lm would otherwise take the
    dtype from the config, which is the same for fp32 fixtures but explicit is
    safer). Quantized ones keep the source dtype for scales and biases.
    """
    from mlx_lm.convert import convert

    out_path = Path(out_path)
    if out_path.exists():
        # mlx-lm refuses to write into an existing folder.
        shutil.rmtree(out_path)
    if bits is None and dtype is None:
        dtype = "float32"
    # The converter prints progress; keep test output clean.
    with contextlib.redirect_stdout(io.StringIO()):
        convert(
            str(hf_path),
            mlx_path=str(out_path),
            quantize=bits is not None,
            q_bits=bits,
            q_group_size=group_size if bits is not None else None,
            dtype=dtype,
        )
    return out_path


# ---------------------------------------------------------------------------
# Named variants
# ---------------------------------------------------------------------------

FAMILIES: Dict[str, Dict[str, Any]] = {
    "qwen3_next": dict(family="qwen3_next"),
    "qwen3_5": dict(family="qwen3_5"),
    "qwen3_5_tied": dict(family="qwen3_5", tie_word_embeddings=True),
    "qwen3_5_moe": dict(family="qwen3_5_moe", expert_layout="per_expert"),
    "qwen3_6_moe": dict(family="qwen3_5_moe", expert_layout="fused"),
}

QUANT_BITS = (4, 8)


def build_variant(
    name: str,
    outdir,
    *,
    bits: Iterable[int] = QUANT_BITS,
    mlx_float: bool = False,
) -> Dict[str, Path]:
    """Build one named variant: {"hf": ..., "mlx_4bit": ..., "mlx_8bit": ...}
    (+ "mlx_float32" when ``mlx_float``)."""
    outdir = Path(outdir)
    spec = FAMILIES[name]
    paths = {"hf": write_hf_checkpoint(outdir / name / "hf", **spec)}
    for b in bits:
        paths[f"mlx_{b}bit"] = write_mlx_conversion(
            paths["hf"], outdir / name / f"mlx_{b}bit", bits=b
        )
    if mlx_float:
        paths["mlx_float32"] = write_mlx_conversion(paths["hf"], outdir / name / "mlx_float32")
    return paths


def build_all(
    outdir,
    names: Optional[Iterable[str]] = None,
    *,
    bits: Iterable[int] = QUANT_BITS,
    mlx_float: bool = False,
) -> Dict[str, Dict[str, Path]]:
    """Build every variant of FAMILIES (or ``names``) under ``outdir/<name>/``."""
    names = list(FAMILIES) if names is None else list(names)
    return {n: build_variant(n, outdir, bits=bits, mlx_float=mlx_float) for n in names}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Write tiny Qwen3-Next/3.5/3.6 MTP fixtures.")
    parser.add_argument("outdir")
    parser.add_argument("--names", nargs="*", default=None, help=f"subset of {list(FAMILIES)}")
    parser.add_argument("--mlx-float", action="store_true", help="also write fp32 mlx conversions")
    args = parser.parse_args(argv)
    tic = time.perf_counter()
    paths = build_all(args.outdir, args.names, mlx_float=args.mlx_float)
    for name, kinds in paths.items():
        for kind, p in kinds.items():
            print(f"{name:14s} {kind:12s} {p}")
    print(f"built in {time.perf_counter() - tic:.1f}s")


if __name__ == "__main__":
    main()
