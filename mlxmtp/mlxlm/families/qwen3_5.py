"""Qwen3.5 (dense): mlx-lm's qwen3_5.py, the text model nested under `language_model`."""

from .base import Family

FAMILY = Family("qwen3_5", "qwen3_5", "DecoderLayer", "GatedDeltaNet", "Attention", "MLP", "SparseMoeBlock",
                text_prefix="model.language_model", expert_layout=None)
