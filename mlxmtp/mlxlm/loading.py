"""Loading through mlx-lm: models with their tokenizers, configs, tokenizers alone.

mlx-lm is imported on use: it takes seconds, and `mlxmtp inspect` and the CLI's start-up
never need it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import mlx.core as mx

from .family import text_parts
from .pipeline import split_backbone
from .token_text import exact_text


def load(model_dir: Path, lazy: bool = False, tokenizer_config: Optional[dict] = None,
         adapter_path: Optional[Path] = None):
    """(model, tokenizer) of a local MLX or HF folder, as `mlx_lm.load` makes them.
    `tokenizer_config`: extra tokenizer settings, e.g. {"chat_template": ...};
    `adapter_path`: a folder of LoRA / DoRA / full fine-tuned weights from `mlx_lm.lora`."""
    # mlx-lm on use (see the module docstring)
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir), lazy=lazy, tokenizer_config=tokenizer_config)
    if adapter_path is not None:
        model = apply_adapters(model, adapter_path)
    return model, exact_text(tokenizer)


class AdapterError(ValueError):
    pass


def apply_adapters(model, adapter_path: Path):
    """The model with an adapter folder applied, as `mlx_lm.load(adapter_path=...)` applies
    it; a folder mlx-lm cannot apply (files missing or unreadable, shapes of another model)
    is an AdapterError saying why, where mlx-lm raises whatever its readers raise."""
    # mlx-lm on use (see the module docstring)
    from mlx_lm.tuner.utils import load_adapters

    try:
        model = load_adapters(model, str(adapter_path))
    except Exception as e:  # noqa: BLE001 - mlx-lm's config and weight readers raise all kinds
        raise AdapterError(f"cannot apply the adapters in {adapter_path}: {e}") from e
    model.eval()
    return model


def wire_recommended_memory() -> Optional[int]:
    """Keep memory up to the device's recommended working set resident (wired), as mlx-lm's
    server and `generate` do: on Apple GPUs macOS may otherwise page a large model's
    weights out between requests. A no-op where the device reports no recommended working
    set (the CPU, CUDA); -> that size, or None."""
    # mlx-lm on use (see the module docstring)
    from mlx_lm.utils import maybe_set_recommended_wired_limit

    if maybe_set_recommended_wired_limit() is None:
        return None
    return mx.device_info()["max_recommended_working_set_size"]


def parse_size(text: str) -> int:
    """Bytes of a size as mlx-lm's server options take one ("8G", "500MB", "1000000"; M and
    G are 10**6 and 10**9); a text mlx-lm cannot read is a ValueError."""
    # mlx-lm on use (see the module docstring)
    from mlx_lm.utils import _parse_size

    try:
        return _parse_size(text)
    except (ArithmeticError, KeyError, ValueError):  # decimal's InvalidOperation: no number; KeyError: the unit
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with M, MB, G or GB "
                         "(10**6, 10**9 bytes)") from None


def load_model(model_dir: Path, lazy: bool = True):
    """(model, config) without the tokenizer."""
    # mlx-lm on use (see the module docstring)
    from mlx_lm.utils import load_model as _load_model

    return _load_model(Path(model_dir), lazy=lazy)


def load_config(model_dir: Path) -> dict:
    """config.json with generation_config's eos_token_id merged in, as `mlx_lm.load` does."""
    # mlx-lm on use (see the module docstring)
    from mlx_lm.utils import load_config as _load_config

    return _load_config(Path(model_dir))


def load_tokenizer(model_dir: Path, eos_token_ids: Optional[list] = None, tokenizer_config: Optional[dict] = None):
    # mlx-lm on use (see the module docstring)
    from mlx_lm.utils import load_tokenizer as _load_tokenizer

    return exact_text(_load_tokenizer(Path(model_dir), tokenizer_config_extra=tokenizer_config,
                                      eos_token_ids=eos_token_ids))


def load_pipelined(model_dir: Path, group, split, strict: bool = True, tokenizer_config: Optional[dict] = None):
    """(model, tokenizer) holding only this rank's layers of a pipeline split (pipeline.py):
    the model is built lazily, the other ranks' layers are dropped, and only then are the
    weights read, so a rank's memory is its share. strict=False when the folder holds this
    rank's weight files only (a partial download), as mlx-lm's own sharded_load does."""
    # mlx-lm on use (see the module docstring)
    from mlx_lm.utils import load_model as _load_model

    model, config = _load_model(Path(model_dir), lazy=True, strict=strict)
    split_backbone(text_parts(model).backbone, group, split)
    mx.eval(model.parameters())
    return model, load_tokenizer(Path(model_dir), eos_token_ids=config.get("eos_token_id"),
                                 tokenizer_config=tokenizer_config)
