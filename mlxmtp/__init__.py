"""mlxmtp: MLX inference with the built-in multi-token-prediction head of Qwen3-Next / Qwen3.5 / Qwen3.6."""

__version__ = "0.1.0"


def load(path_or_hf_id=None, mtp=True, **kwargs):
    """Load an mlx-lm model and tokenizer with the MTP head attached (see mlxmtp.models.load)."""
    # On use: `import mlxmtp` stays light (no MLX) for the CLI's start-up.
    from .models.load import load as _load

    return _load(path_or_hf_id, mtp=mtp, **kwargs)


__all__ = ["__version__", "load"]
