"""Qwen3-Next: mlx-lm's qwen3_next.py, a flat text model; its checkpoints store each
expert's weights apart."""

from .base import Family

FAMILY = Family("qwen3_next", "qwen3_next", "Qwen3NextDecoderLayer", "Qwen3NextGatedDeltaNet", "Qwen3NextAttention",
                "Qwen3NextMLP", "Qwen3NextSparseMoeBlock", text_prefix="model", expert_layout="per_expert")
