"""The tiny fixture checkpoints are real: stock mlx-lm and transformers load them."""

import glob
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxmtp.testing import fixtures as fx

NAMES = list(fx.FAMILIES)
PROMPT = "the cat sat on the mat and then the dog ran into the house"


def _tensors(folder):
    """name -> (file name, array) over every model*.safetensors in folder."""
    out = {}
    for f in sorted(glob.glob(str(Path(folder) / "model*.safetensors"))):
        for k, v in mx.load(f).items():
            out[k] = (Path(f).name, v)
    return out


def _logits(model, ids):
    out = model(mx.array([ids]))
    mx.eval(out)
    return np.array(out.astype(mx.float32))


@pytest.mark.parametrize("name", NAMES)
def test_hf_checkpoint_loads_in_stock_mlx_lm(fixture_models, name):
    import mlx_lm

    model, tok = mlx_lm.load(str(fixture_models[name]["hf"]))
    ids = tok.encode(PROMPT)
    logits = _logits(model, ids)
    vocab = fx.text_config(fx.make_config(fx.FAMILIES[name]["family"]))["vocab_size"]
    assert logits.shape == (1, len(ids), vocab)
    assert np.isfinite(logits).all()

    # Far from flat: greedy argmax is well separated almost everywhere.
    top = np.sort(logits[0], axis=-1)
    gaps = top[:, -1] - top[:, -2]
    assert np.median(gaps) > 0.1
    assert (gaps > 1e-3).mean() > 0.9

    # The output depends on the context, not only on the last token.
    other = tok.encode("a red fox jumped over it, then the dog ran into the house")
    assert other[-3:] == ids[-3:]
    assert np.abs(_logits(model, other)[0, -1] - logits[0, -1]).max() > 0.1

    # mlx-lm drops the head, so the loaded model has no mtp parameters.
    from mlx.utils import tree_flatten

    assert not any("mtp" in k for k, _ in tree_flatten(model.parameters()))


@pytest.mark.parametrize("name", NAMES)
def test_hf_layout(fixture_models, name):
    path = fixture_models[name]["hf"]
    spec = fx.FAMILIES[name]
    config = json.loads((path / "config.json").read_text())
    tc = fx.text_config(config)
    tensors = _tensors(path)

    index = json.loads((path / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert weight_map == {k: f for k, (f, _) in tensors.items()}
    assert index["metadata"]["total_size"] == sum(v.nbytes for _, v in tensors.values())
    files = sorted(set(weight_map.values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    mtp_files = {weight_map[k] for k in weight_map if k.startswith("mtp.")}
    assert mtp_files - {files[-1]}, "some mtp.* tensor must live outside the last shard"

    H = tc["hidden_size"]
    expected = [
        "mtp.fc.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight",
        "mtp.layers.0.input_layernorm.weight",
        "mtp.layers.0.post_attention_layernorm.weight",
        "mtp.layers.0.self_attn.q_norm.weight",
        "mtp.layers.0.self_attn.k_norm.weight",
    ] + [f"mtp.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
    for k in expected:
        assert k in tensors, k
    assert tensors["mtp.fc.weight"][1].shape == (H, 2 * H)
    nh, hd = tc["num_attention_heads"], tc["head_dim"]
    assert tensors["mtp.layers.0.self_attn.q_proj.weight"][1].shape == (2 * nh * hd, H)

    mlp = "mtp.layers.0.mlp"
    E, I = tc.get("num_experts", 0), tc.get("moe_intermediate_size", 0)
    if spec["family"] == "qwen3_5":
        assert f"{mlp}.gate_proj.weight" in tensors
        assert not any("experts" in k for k in tensors)
    elif spec.get("expert_layout") == "fused":
        assert tensors[f"{mlp}.experts.gate_up_proj"][1].shape == (E, 2 * I, H)
        assert tensors[f"{mlp}.experts.down_proj"][1].shape == (E, H, I)
    else:
        for e in range(E):
            assert tensors[f"{mlp}.experts.{e}.gate_proj.weight"][1].shape == (I, H)
            assert tensors[f"{mlp}.experts.{e}.down_proj.weight"][1].shape == (H, I)
    if spec["family"] != "qwen3_5":
        assert tensors[f"{mlp}.gate.weight"][1].shape == (E, H)
        assert tensors[f"{mlp}.shared_expert_gate.weight"][1].shape == (1, H)

    # Main-model prefixes and expert layouts.
    if spec["family"] == "qwen3_next":
        assert "model.embed_tokens.weight" in tensors
        assert "model.layers.0.mlp.experts.0.up_proj.weight" in tensors
        assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in tensors
        assert "num_nextn_predict_layers" not in config
    else:
        assert tc["mtp_num_hidden_layers"] == 1
        assert "model.language_model.embed_tokens.weight" in tensors
        assert any(k.startswith("model.visual.") for k in tensors)
        assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in tensors
    if spec["family"] == "qwen3_5_moe":
        gate_up = tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"][1]
        assert gate_up.shape == (E, 2 * I, H)
    assert ("lm_head.weight" in tensors) != bool(spec.get("tie_word_embeddings"))
    assert config["tie_word_embeddings"] == tc["tie_word_embeddings"]

    # HF norm conventions: zero-centred norms stored without the +1, the gated
    # DeltaNet norm a plain weight around 1; torch conv layout [C, 1, K].
    for k, (_, v) in tensors.items():
        if k.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight", "norm.weight")):
            mean = float(mx.mean(v))
            if "linear_attn.norm" in k:
                assert abs(mean - 1.0) < 0.2, k
            else:
                assert abs(mean) < 0.2, k
        if k.endswith("conv1d.weight"):
            assert v.shape[1] == 1 and v.shape[2] == tc["linear_conv_kernel_dim"]


@pytest.mark.parametrize("bits", fx.QUANT_BITS)
@pytest.mark.parametrize("name", NAMES)
def test_quantized_conversions_drop_the_head(fixture_models, name, bits):
    import mlx_lm

    path = fixture_models[name][f"mlx_{bits}bit"]
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"]["bits"] == bits
    assert config["quantization"]["group_size"] == 64
    tensors = _tensors(path)
    assert not any(k.startswith("mtp.") or ".mtp." in k for k in tensors)
    # Every Linear got quantized (input dims are multiples of 64).
    assert not any(
        k.endswith("proj.weight") and v.dtype != mx.uint32 for k, (_, v) in tensors.items()
    )

    model, tok = mlx_lm.load(str(path))
    logits = _logits(model, tok.encode(PROMPT))
    assert np.isfinite(logits).all()


def test_unquantized_conversion_stays_float32(tmp_path, fixture_model):
    hf = fixture_model("qwen3_5")["hf"]
    out = fx.write_mlx_conversion(hf, tmp_path / "fp32")
    tensors = _tensors(out)
    assert {v.dtype for _, v in tensors.values()} == {mx.float32}
    assert not any("mtp" in k for k in tensors)


def test_bf16_and_single_file(tmp_path):
    import mlx_lm

    # Dense: MLX's CPU gather_mm (the MoE experts) only runs float32.
    path = fx.write_hf_checkpoint(tmp_path / "bf16", "qwen3_5", dtype="bfloat16", num_shards=1)
    assert not (path / "model.safetensors.index.json").exists()
    tensors = _tensors(path)
    assert set(f for f, _ in tensors.values()) == {"model.safetensors"}
    for k, (_, v) in tensors.items():
        # A_log stays float32, as in the real Qwen3.5 checkpoints.
        assert v.dtype == (mx.float32 if k.endswith("A_log") else mx.bfloat16), k
    config = json.loads((path / "config.json").read_text())
    assert config["text_config"]["dtype"] == "bfloat16"
    model, tok = mlx_lm.load(str(path))
    assert np.isfinite(_logits(model, tok.encode(PROMPT))).all()


def test_without_head_and_overrides(tmp_path):
    import mlx_lm

    path = fx.write_hf_checkpoint(
        tmp_path / "nohead", "qwen3_next", with_mtp=False, num_hidden_layers=8, seed=3
    )
    tensors = _tensors(path)
    assert not any(k.startswith("mtp.") for k in tensors)
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 8
    assert "model.layers.7.self_attn.q_proj.weight" in tensors
    assert "model.layers.6.linear_attn.A_log" in tensors
    model, _ = mlx_lm.load(str(path))
    assert len(model.layers) == 8

    # Same seed, with the head: the main weights are identical.
    with_head = _tensors(
        fx.write_hf_checkpoint(tmp_path / "head", "qwen3_next", num_hidden_layers=8, seed=3)
    )
    k = "model.layers.5.mlp.experts.3.down_proj.weight"
    assert mx.array_equal(with_head[k][1], tensors[k][1])


def test_deterministic():
    cfg = fx.make_config("qwen3_5")
    a = fx.make_weights("qwen3_5", cfg, seed=0)
    b = fx.make_weights("qwen3_5", cfg, seed=0)
    c = fx.make_weights("qwen3_5", cfg, seed=1)
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["mtp.fc.weight"], c["mtp.fc.weight"])


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return fx.write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


def test_tokenizer_basics(hf_tokenizer):
    tok = hf_tokenizer
    assert 250 <= len(tok) <= 320 and len(tok) == fx.tokenizer_size()
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    for t in fx.SPECIAL_TOKENS + fx.ADDED_TOKENS:
        assert tok.convert_tokens_to_ids(t) == fx.token_id(t)
        assert tok.encode(t, add_special_tokens=False) == [fx.token_id(t)]
    texts = [
        "Hello, world! The quick brown fox.\n\n    def f(x):\n\treturn x  # ok",
        "héllo wörld, 日本語のテキスト, emoji 🎉🚀, e\u0301, tab\tand \r\n crlf",
        "".join(chr(i) for i in range(1, 128)),
        "<think>\nreasoning</think>\n\n<tool_call>\n{}\n</tool_call>",
    ]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # Think / tool-call tags are not special: they survive skip_special_tokens.
    ids = tok.encode("<|im_start|>a<think>b</think><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b</think>"


def test_mlx_lm_tokenizer(tokenizer_dir):
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    assert tok.has_thinking and tok.think_start == "<think>"
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"
    assert isinstance(tok.detokenizer, BPEStreamingDetokenizer)
    assert fx.token_id("<|im_end|>") in tok.eos_token_ids

    detok = tok.detokenizer
    detok.reset()
    text = "streaming héllo 🎉 world"
    for t in tok.encode(text, add_special_tokens=False):
        detok.add_token(t)
    detok.finalize()
    assert detok.text == text


def test_model_eos_ids(fixture_models):
    import mlx_lm

    _, tok = mlx_lm.load(str(fixture_models["qwen3_5"]["hf"]))
    assert set(tok.eos_token_ids) == {fx.token_id("<|im_end|>"), fx.token_id("<|endoftext|>")}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_JSON = (
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
    '"required": ["city"]}}}'
)
TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + TOOL_JSON
    + "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def test_chat_template_tools_no_thinking(hf_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    text = hf_tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, enable_thinking=False, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nBe brief.\n\n"
        + TOOLS_SYSTEM
        + "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_chat_template_tool_round_trip(hf_tokenizer):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    text = hf_tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\n" + TOOLS_SYSTEM + "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_chat_template_plain(hf_tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"},
        {"role": "user", "content": "Bye"},
    ]
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # Reasoning of earlier turns is dropped, as in Qwen3.
    assert text == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )


def test_script_entry_point(tmp_path, capsys):
    fx.main([str(tmp_path), "--names", "qwen3_5_tied"])
    out = capsys.readouterr().out
    assert str(tmp_path / "qwen3_5_tied" / "hf") in out
    assert (tmp_path / "qwen3_5_tied" / "mlx_4bit" / "config.json").exists()


def test_moe_fixture_state_does_not_depend_on_how_forwards_split_it(fixture_model):
    """scripts/moe_reference_probe.py, run here: on this backend one forward, sorted and
    unsorted expert chunks and one token at a time leave the MoE fixture in one state (the
    rollback and batch tests rely on it; the probe is what to run where they fail)."""
    import importlib.util

    import mlx_lm

    path = Path(__file__).parent.parent / "scripts" / "moe_reference_probe.py"
    spec = importlib.util.spec_from_file_location("moe_reference_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    model, _ = mlx_lm.load(str(fixture_model("qwen3_6_moe")["hf"]))
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 290, 70)]
    plain = probe.layer_states(probe.caches_after(model, tokens, [12] + [1] * 58))
    for chunks in ([70], [32, 32, 6], [8] * 8 + [6]):
        for a, b in zip(probe.layer_states(probe.caches_after(model, tokens, chunks)), plain):
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
