"""The default model: the small trained demo model shipped in the package
(`mlxmtp/demo_model/`, built by scripts/train_demo_model.py), served as `mlxmtp-demo`.

Every command that takes a model takes the demo by that name (`--model mlxmtp-demo`,
`inspect mlxmtp-demo`, `add-mtp-weights --source mlxmtp-demo`), and those that default to
a model default to it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

PACKAGED = Path(__file__).resolve().parent.parent / "demo_model"
NAME = "mlxmtp-demo"  # the name it is served under, and the name every command takes it by
# The output limit of a request to the demo that sets none (as if served with --max-tokens
# 256): without one the demo writes to the end of its 4096-token context (about two minutes
# on a 2-core CPU), as a model that never learnt to end a turn does. 256 tokens are
# `mlxmtp generate`'s default too: seconds on a CPU, and enough drafting cycles (a hundred or
# more) for the MTP statistics of the answer to mean something. A real model keeps running
# to the end of its turn.
MAX_TOKENS = 256


def demo_model_path() -> Path:
    if not (PACKAGED / "config.json").exists():
        raise FileNotFoundError(
            f"the demo model is missing from {PACKAGED}: this mlxmtp installation is incomplete "
            "(reinstall it, or pass a model path)"
        )
    return PACKAGED


def names_demo(model: Optional[str]) -> bool:
    """Whether a model as the commands take it means the demo: none given, its name
    `mlxmtp-demo` (unless a folder of that name is here: a folder is taken as it is), or
    the packaged folder's own path."""
    if model is None:
        return True
    path = Path(str(model)).expanduser()
    if str(model) == NAME:
        return not path.exists()
    try:
        return path.exists() and path.resolve() == PACKAGED
    except OSError:
        return False


def resolve(model: Optional[str]) -> Optional[str]:
    """The demo's folder where `model` names the demo by name or by default, else `model`
    as given (a folder, a Hugging Face repo id)."""
    if model is None or (str(model) == NAME and names_demo(model)):
        return str(demo_model_path())
    return model


def export_head(out: Path) -> Path:
    """Write the demo's MTP head as a Hugging Face checkpoint holds one (`mtp.*` tensors,
    zero-centred norms stored without their +1) beside the demo's config.json, in folder
    `out`: the source `mlxmtp add-mtp-weights --source mlxmtp-demo` repairs a quantized copy
    of the demo from, offline. Converting it back gives the shipped head bit for bit: its
    float16 norms lie between 0.5 and 4, where w - 1 + 1 is exact (tests/test_add_mtp_weights.py)."""
    # On use: the demo's name is resolved by commands that never load MLX (seconds).
    import shutil

    import mlx.core as mx  # (as above)

    from ..checkpoint import hf_head, mtp_folder  # (as above)

    config, weights = mtp_folder.read_mtp_folder(demo_model_path())
    if config.get("quantization") or config.get("expert_layout") != "dense":
        raise ValueError(f"the demo's head in {PACKAGED / mtp_folder.FOLDER} is not a dense unquantized head")
    tensors = {hf_head.MTP_PREFIX + name: w - 1.0 if w.ndim == 1 and hf_head.is_zero_centred_norm(name) else w
               for name, w in weights.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PACKAGED / "config.json", out / "config.json")
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "pt"})
    return out
