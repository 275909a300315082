"""The fixtures' configs: Qwen3-Next / Qwen3.5 / Qwen3.6 `config.json` in each family's real
layout (text config nested under a vision stub for Qwen3.5), at tiny sizes."""

from __future__ import annotations

from typing import Any, Dict, List

from .fixture_tokenizer import EOS_TOKEN, PAD_TOKEN, token_id

# Every Linear input dim is a multiple of 64 so mlx-lm quantizes every layer at
# group size 64 (it silently skips layers whose input dim does not divide).
DEFAULT_SIZES: Dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=4,
    full_attention_interval=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    vocab_size=320,
    partial_rotary_factor=0.25,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
)

FAMILY_NAMES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def _layer_types(n_layers: int, interval: int) -> List[str]:
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
    ]


def _mrope_section(head_dim: int, partial: float) -> List[int]:
    # Real checkpoints split half the rotary dims 11:11:10 (t, h, w); mlx-lm
    # ignores it for text, but keep it consistent with the tiny head_dim.
    half = int(head_dim * partial) // 2
    t = h = round(half * 11 / 32)
    return [t, h, half - t - h]


def make_config(
    family: str,
    *,
    dtype: str = "float32",
    tie_word_embeddings: bool = False,
    **overrides,
) -> Dict[str, Any]:
    """The config.json dict for a tiny model of ``family``.

    ``overrides`` replace model fields (in ``text_config`` for the nested
    Qwen3.5 families). ``num_nextn_predict_layers`` is omitted for qwen3_next
    unless given, as in most real checkpoints.
    """
    if family not in FAMILY_NAMES:
        raise ValueError(f"unknown family {family!r}, expected one of {FAMILY_NAMES}")
    s = {**DEFAULT_SIZES, **overrides}
    common = _common_fields(s, tie_word_embeddings)
    if family == "qwen3_next":
        cfg = _qwen3_next_config(s, common, dtype)
    else:
        cfg = _qwen3_5_config(family, s, common, dtype, tie_word_embeddings)
    # Fields of the DEFAULT_SIZES kind were applied above; anything else given
    # (num_nextn_predict_layers, mtp_num_hidden_layers, norm_topk_prob, ...)
    # lands verbatim in the model's field set.
    target = cfg if family == "qwen3_next" else cfg["text_config"]
    for k, v in overrides.items():
        if k not in DEFAULT_SIZES or k in target:
            target[k] = v
    cfg["transformers_version"] = "4.57.0"
    return cfg


# The DEFAULT_SIZES fields every family carries among its model fields, in config order.
_COMMON_SIZES = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "full_attention_interval", "rms_norm_eps", "vocab_size",
    "max_position_embeddings",
)


def _common_fields(s: Dict[str, Any], tie_word_embeddings: bool) -> Dict[str, Any]:
    """The model fields shared by every family, from the sizes ``s``."""
    # Qwen: bos is <|endoftext|> (never prepended), eos is <|im_end|>.
    return dict(
        **{k: s[k] for k in _COMMON_SIZES},
        attention_bias=False,
        attention_dropout=0.0,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=tie_word_embeddings,
        use_cache=True,
        bos_token_id=token_id(PAD_TOKEN),
        eos_token_id=token_id(EOS_TOKEN),
    )


def _moe_fields(s: Dict[str, Any]) -> Dict[str, Any]:
    return dict(
        num_experts=s["num_experts"],
        num_experts_per_tok=s["num_experts_per_tok"],
        moe_intermediate_size=s["moe_intermediate_size"],
        shared_expert_intermediate_size=s["shared_expert_intermediate_size"],
        norm_topk_prob=True,
        decoder_sparse_step=1,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
    )


def _qwen3_next_config(s: Dict[str, Any], common: Dict[str, Any], dtype: str) -> Dict[str, Any]:
    """A flat Qwen3-Next config: MoE in every layer, rope fields at the top level."""
    return dict(
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        **common,
        **_moe_fields(s),
        intermediate_size=s["intermediate_size"],
        mlp_only_layers=[],
        partial_rotary_factor=s["partial_rotary_factor"],
        rope_theta=s["rope_theta"],
        rope_scaling=None,
        use_sliding_window=False,
        torch_dtype=dtype,
    )


def _qwen3_5_config(
    family: str, s: Dict[str, Any], common: Dict[str, Any], dtype: str, tie_word_embeddings: bool
) -> Dict[str, Any]:
    """A nested Qwen3.5 config (dense or MoE): model fields in ``text_config``, next to
    a vision-tower stub."""
    text = _qwen3_5_text_config(family, s, common, dtype)
    if family == "qwen3_5":
        text["intermediate_size"] = s["intermediate_size"]
        arch = "Qwen3_5ForConditionalGeneration"
    else:
        text.update(_moe_fields(s))
        arch = "Qwen3_5MoeForConditionalGeneration"
    return dict(
        architectures=[arch],
        model_type=family,
        text_config=text,
        vision_config=_vision_stub_config(family, s["hidden_size"]),
        tie_word_embeddings=tie_word_embeddings,
        image_token_id=token_id(PAD_TOKEN),
        video_token_id=token_id(PAD_TOKEN),
    )


def _qwen3_5_text_config(family: str, s: Dict[str, Any], common: Dict[str, Any], dtype: str) -> Dict[str, Any]:
    return dict(
        model_type=f"{family}_text",
        **common,
        layer_types=_layer_types(s["num_hidden_layers"], s["full_attention_interval"]),
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
        attn_output_gate=True,
        mamba_ssm_dtype="float32",
        rope_parameters=dict(
            rope_type="default",
            rope_theta=s["rope_theta"],
            partial_rotary_factor=s["partial_rotary_factor"],
            mrope_section=_mrope_section(s["head_dim"], s["partial_rotary_factor"]),
            mrope_interleaved=True,
        ),
        dtype=dtype,
    )


def _vision_stub_config(family: str, hidden_size: int) -> Dict[str, Any]:
    # A stub: mlx-lm drops the vision tower, but real configs carry one.
    return dict(
        model_type=family,
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=2,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=hidden_size,
        num_position_embeddings=16,
    )


def text_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """The model-field dict of a config (text_config when nested)."""
    return config.get("text_config", config)


def num_mtp_layers(config: Dict[str, Any]) -> int:
    tc = text_config(config)
    return int(tc.get("mtp_num_hidden_layers", tc.get("num_nextn_predict_layers", 1)))
