"""Qwen3.5 MoE: mlx-lm's qwen3_5_moe.py builds Qwen3.5's layers (qwen3_5.py); the
checkpoints fuse the experts."""

from .base import Family

FAMILY = Family("qwen3_5_moe", "qwen3_5", "DecoderLayer", "GatedDeltaNet", "Attention", "MLP", "SparseMoeBlock",
                text_prefix="model.language_model", expert_layout="fused")
