"""Tiny random-weight checkpoints in the real Qwen3-Next / Qwen3.5 / Qwen3.6 layouts.

Everything here is written in seconds from a seeded numpy RNG, so tests can
exercise the real loading paths (HF sharded safetensors with an ``mtp.*`` head,
mlx-lm conversions that dropped the head) without downloading a model.

    python -m mlxmtp.testing.fixtures OUTDIR

builds every variant in ``FAMILIES`` (HF fp32 + 4-bit and 8-bit mlx-lm
conversions) into OUTDIR and prints the paths.

Layout facts follow /work/shared/docs/mtp-reference.md and the ``sanitize``
methods of mlx-lm's qwen3_next.py / qwen3_5.py / qwen3_5_moe.py (0.32.x).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import numpy as np

# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Not special in Qwen3 either: they must survive skip_special_tokens=True so the
# reasoning / tool-call parsers can see them in decoded text.
ADDED_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Qwen2/3 pre-tokenizer split: contractions, letter runs, single digits,
# punctuation runs, newlines, whitespace.
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A hand-picked merge list (byte-level symbols, "Ġ" is a space) so the BPE is
# fully deterministic without training. Each merge only uses symbols that exist
# by the time it is applied.
# fmt: off
_MERGES = [
    ("Ġ", "t"), ("h", "e"), ("Ġ", "a"), ("i", "n"), ("Ġt", "he"), ("e", "r"),
    ("o", "n"), ("r", "e"), ("a", "t"), ("e", "n"), ("o", "r"), ("e", "s"),
    ("Ġ", "s"), ("Ġ", "w"), ("i", "s"), ("Ġ", "o"), ("Ġ", "c"), ("a", "n"),
    ("Ġ", "b"), ("Ġ", "f"), ("Ġ", "i"), ("Ġ", "p"), ("e", "d"), ("in", "g"),
    ("Ġ", "m"), ("Ġ", "d"), ("o", "u"), ("l", "l"), ("Ġt", "o"), ("Ġa", "n"),
    ("Ġo", "f"), ("Ġan", "d"), ("Ġ", "h"), ("i", "t"), ("a", "r"), ("Ġi", "s"),
    ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("Ċ", "Ċ"), ("Ġ", "{"),
]
# fmt: on


def _bytes_to_unicode() -> Dict[int, str]:
    # GPT-2's reversible byte -> printable-unicode map used by ByteLevel BPE.
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


# A Qwen3-style ChatML template: tools rendered as JSON schemas inside <tools>,
# assistant tool calls as JSON inside <tool_call>, tool results grouped into one
# user turn inside <tool_response>, reasoning kept only after the last real user
# query, and enable_thinking=false pre-filling an empty think block.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def _build_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    byte_symbols = list(_bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(byte_symbols)}
    for a, b in _MERGES:
        assert a in vocab and b in vocab, (a, b)
        vocab[a + b] = len(vocab)

    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=list(_MERGES),
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    # No NFC normalizer (Qwen has one): fixtures promise exact byte round-trips.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Order matters: ids are assigned in the order the tokens are added.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tok


def write_tokenizer(path) -> Path:
    """Write a ~300-token byte-level BPE tokenizer with Qwen3's specials and chat
    template (tokenizer.json, tokenizer_config.json, special_tokens_map.json)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_tokenizer(_build_tokenizer(), path)
    return path


def save_tokenizer(tok, path: Path) -> None:
    """Save a `tokenizers.Tokenizer` that has Qwen3's special and added tokens as an
    offline-loadable HF tokenizer folder with the ChatML chat template (also used by
    scripts/train_demo_model.py for its trained tokenizer)."""
    tok.save(str(path / "tokenizer.json"))
    added = {}
    for t in SPECIAL_TOKENS + ADDED_TOKENS:
        added[str(tok.token_to_id(t))] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
    # PreTrainedTokenizerFast (not Qwen2Tokenizer): transformers 5 rebuilds a
    # Qwen2Tokenizer's pipeline itself, this class uses tokenizer.json as written.
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    _write_json(path / "tokenizer_config.json", config)
    _write_json(
        path / "special_tokens_map.json",
        {
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
        },
    )


def tokenizer_size() -> int:
    """Number of tokens (base vocab + added), without writing anything."""
    return 256 + len(_MERGES) + len(SPECIAL_TOKENS) + len(ADDED_TOKENS)


def token_id(token: str) -> int:
    """Id of a special / added token in the fixture tokenizer."""
    extra = SPECIAL_TOKENS + ADDED_TOKENS
    return 256 + len(_MERGES) + extra.index(token)


# ---------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------


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
    is_moe = family in ("qwen3_next", "qwen3_5_moe")
    if not is_moe and expert_layout is not None:
        raise ValueError("expert_layout needs an MoE family")
    # Main-model experts: per-expert tensors in Qwen3-Next, fused in Qwen3.5
    # MoE. The MTP experts are per-expert unless asked otherwise (Qwen3.6).
    main_layout = ("per_expert" if family == "qwen3_next" else "fused") if is_moe else None
    mtp_layout = (expert_layout or "per_expert") if is_moe else None
    m = "model" if family == "qwen3_next" else "model.language_model"
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


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


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
