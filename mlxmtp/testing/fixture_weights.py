"""The fixtures' weights: seeded random tensors under the real HF names, `mtp.*` head included
(MoE experts per expert or fused, as the two Qwen3.5-MoE layouts store them)."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import numpy as np

from ..mlxlm.family import FAMILIES
from .fixture_configs import num_mtp_layers, text_config
from .fixture_tokenizer import ADDED_TOKENS, SPECIAL_TOKENS, tokenizer_size


class _Init:
    """Seeded draws. Projections use std = gain / sqrt(fan_in) so every block
    adds a residual update about as large as its input: the output then depends
    on the context (cache / state bugs show up) and the logits are far from flat."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def normal(self, shape, std) -> np.ndarray:
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def linear(self, out_dim, in_dim, gain=1.0) -> np.ndarray:
        return self.normal((out_dim, in_dim), gain / math.sqrt(in_dim))

    def zc_norm(self, dim) -> np.ndarray:
        # HF stores Qwen3-Next/3.5 RMSNorm weights zero-centred (applied as 1 + w).
        return self.normal((dim,), 0.1)

    def plain_norm(self, dim) -> np.ndarray:
        return 1.0 + self.normal((dim,), 0.1)


def _attention(init: _Init, p: str, s: Dict[str, Any]) -> Dict[str, np.ndarray]:
    H, nh, nkv, hd = (
        s["hidden_size"],
        s["num_attention_heads"],
        s["num_key_value_heads"],
        s["head_dim"],
    )
    return {
        # 2x wide: per head [query | output gate].
        f"{p}.q_proj.weight": init.linear(nh * hd * 2, H),
        f"{p}.k_proj.weight": init.linear(nkv * hd, H),
        f"{p}.v_proj.weight": init.linear(nkv * hd, H),
        f"{p}.o_proj.weight": init.linear(H, nh * hd),
        f"{p}.q_norm.weight": init.zc_norm(hd),
        f"{p}.k_norm.weight": init.zc_norm(hd),
    }


def _gated_deltanet(init: _Init, p: str, s: Dict[str, Any], family: str) -> Dict[str, np.ndarray]:
    H = s["hidden_size"]
    nk, nv = s["linear_num_key_heads"], s["linear_num_value_heads"]
    key_dim = nk * s["linear_key_head_dim"]
    value_dim = nv * s["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    K = s["linear_conv_kernel_dim"]
    w = {}
    if family == "qwen3_next":
        # Fused projections, grouped per key head (mlx-lm splits them again).
        w[f"{p}.in_proj_qkvz.weight"] = init.linear(2 * key_dim + 2 * value_dim, H)
        w[f"{p}.in_proj_ba.weight"] = init.linear(2 * nv, H)
    else:
        w[f"{p}.in_proj_qkv.weight"] = init.linear(conv_dim, H)
        w[f"{p}.in_proj_z.weight"] = init.linear(value_dim, H)
        w[f"{p}.in_proj_b.weight"] = init.linear(nv, H)
        w[f"{p}.in_proj_a.weight"] = init.linear(nv, H)
    # HF (torch) depthwise conv layout [C, 1, K]; mlx-lm moves it to [C, K, 1].
    w[f"{p}.conv1d.weight"] = init.normal((conv_dim, 1, K), 1.0 / math.sqrt(K))
    w[f"{p}.dt_bias"] = 1.0 + init.normal((nv,), 0.1)
    # Decay rates spread log-uniformly so some heads keep a long memory (the
    # recurrent state then matters) and others forget within a few tokens.
    A = np.exp(init.rng.uniform(math.log(0.1), math.log(16.0), size=(nv,)))
    w[f"{p}.A_log"] = np.log(A).astype(np.float32)
    # Gated RMSNorm: plain weight around 1, never shifted.
    w[f"{p}.norm.weight"] = init.plain_norm(s["linear_value_head_dim"])
    w[f"{p}.out_proj.weight"] = init.linear(H, value_dim)
    return w


def _dense_mlp(init: _Init, p: str, H: int, I: int) -> Dict[str, np.ndarray]:
    return {
        f"{p}.gate_proj.weight": init.linear(I, H),
        f"{p}.up_proj.weight": init.linear(I, H),
        f"{p}.down_proj.weight": init.linear(H, I),
    }


def _moe(init: _Init, p: str, s: Dict[str, Any], layout: str) -> Dict[str, np.ndarray]:
    H, E, I = s["hidden_size"], s["num_experts"], s["moe_intermediate_size"]
    w = {f"{p}.gate.weight": init.linear(E, H)}
    gate = np.stack([init.linear(I, H) for _ in range(E)])
    up = np.stack([init.linear(I, H) for _ in range(E)])
    down = np.stack([init.linear(H, I) for _ in range(E)])
    if layout == "per_expert":
        for e in range(E):
            w[f"{p}.experts.{e}.gate_proj.weight"] = gate[e]
            w[f"{p}.experts.{e}.up_proj.weight"] = up[e]
            w[f"{p}.experts.{e}.down_proj.weight"] = down[e]
    elif layout == "fused":
        # transformers 5 layout: [E, 2I, H] with gate rows first, [E, H, I];
        # no ".weight" suffix.
        w[f"{p}.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        w[f"{p}.experts.down_proj"] = down
    else:
        raise ValueError(f"unknown expert layout {layout!r}")
    w.update(_dense_mlp(init, f"{p}.shared_expert", H, s["shared_expert_intermediate_size"]))
    w[f"{p}.shared_expert_gate.weight"] = init.linear(1, H)
    return w


def make_weights(
    family: str,
    config: Dict[str, Any],
    *,
    expert_layout: Optional[str] = None,
    seed: int = 0,
    with_mtp: bool = True,
) -> Dict[str, np.ndarray]:
    """All HF tensors (float32 numpy) of a tiny checkpoint, in HF names."""
    s = text_config(config)
    init = _Init(seed)
    is_moe = FAMILIES[family].expert_layout is not None
    if not is_moe and expert_layout is not None:
        raise ValueError("expert_layout needs an MoE family")
    # Main-model experts: per-expert tensors in Qwen3-Next, fused in Qwen3.5
    # MoE. The MTP experts are per-expert unless asked otherwise (Qwen3.6).
    main_layout = FAMILIES[family].expert_layout
    mtp_layout = (expert_layout or "per_expert") if is_moe else None
    m = FAMILIES[family].text_prefix
    w = _backbone_weights(init, m, s, family, main_layout)
    if family != "qwen3_next":
        # A couple of vision-tower tensors; mlx-lm drops everything model.visual.*.
        w["model.visual.patch_embed.proj.weight"] = init.normal((32, 3, 2, 2, 2), 0.1)
        w["model.visual.merger.linear_fc2.weight"] = init.linear(s["hidden_size"], 32)
    # The MTP head is drawn after the main model so with_mtp=False gives the
    # same main weights.
    mtp = _mtp_weights(init, s, num_mtp_layers(config), mtp_layout)
    if with_mtp:
        w.update(mtp)
    return w


def _backbone_weights(
    init: _Init, m: str, s: Dict[str, Any], family: str, moe_layout: Optional[str]
) -> Dict[str, np.ndarray]:
    """Embeddings, decoder layers, final norm and output head under prefix ``m``;
    ``moe_layout`` None for a dense MLP."""
    H, V = s["hidden_size"], s["vocab_size"]
    w: Dict[str, np.ndarray] = {}
    # Untied: unit-scale embeddings like real checkpoints' residual streams.
    # Tied: the embedding is also the output head, so shrink it to keep the
    # logits as spread as the untied lm_head's (std ~2) instead of one-hot.
    tied = s.get("tie_word_embeddings", False)
    w[f"{m}.embed_tokens.weight"] = init.normal((V, H), 0.25 if tied else 1.0)
    for i in range(s["num_hidden_layers"]):
        p = f"{m}.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = init.zc_norm(H)
        w[f"{p}.post_attention_layernorm.weight"] = init.zc_norm(H)
        if (i + 1) % s["full_attention_interval"] == 0:
            w.update(_attention(init, f"{p}.self_attn", s))
        else:
            w.update(_gated_deltanet(init, f"{p}.linear_attn", s, family))
        w.update(_mlp(init, f"{p}.mlp", s, moe_layout))
    w[f"{m}.norm.weight"] = init.zc_norm(H)
    # Drawn even when tied so the other tensors do not depend on tying.
    lm_head = init.linear(V, H, gain=2.0)
    # Special / added tokens and the padding rows past the tokenizer get ~zero
    # output rows, so greedy decoding of the random model runs to max_tokens
    # instead of stopping at a random <|im_end|> or emitting <think>; tests that
    # need a stop pass their own eos ids.
    first_added = tokenizer_size() - len(SPECIAL_TOKENS) - len(ADDED_TOKENS)
    lm_head[first_added:] *= 0.01
    if tied:
        w[f"{m}.embed_tokens.weight"][first_added:] *= 0.01
    else:
        w["lm_head.weight"] = lm_head
    return w


def _mtp_weights(init: _Init, s: Dict[str, Any], n_layers: int, moe_layout: Optional[str]) -> Dict[str, np.ndarray]:
    """The ``mtp.*`` head: input projection and norms, ``n_layers`` full-attention
    layers, final norm; ``moe_layout`` None for a dense MLP."""
    H = s["hidden_size"]
    mtp: Dict[str, np.ndarray] = {
        "mtp.fc.weight": init.linear(H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": init.zc_norm(H),
        "mtp.pre_fc_norm_hidden.weight": init.zc_norm(H),
    }
    for j in range(n_layers):
        p = f"mtp.layers.{j}"
        mtp[f"{p}.input_layernorm.weight"] = init.zc_norm(H)
        mtp[f"{p}.post_attention_layernorm.weight"] = init.zc_norm(H)
        mtp.update(_attention(init, f"{p}.self_attn", s))
        mtp.update(_mlp(init, f"{p}.mlp", s, moe_layout))
    mtp["mtp.norm.weight"] = init.zc_norm(H)
    return mtp


def _mlp(init: _Init, p: str, s: Dict[str, Any], moe_layout: Optional[str]) -> Dict[str, np.ndarray]:
    if moe_layout is None:
        return _dense_mlp(init, p, s["hidden_size"], s["intermediate_size"])
    return _moe(init, p, s, moe_layout)
