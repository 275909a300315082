"""The MTP head: matches an independent plain-numpy implementation of the reference
math, loads identically from HF tensors and from an `mtp/` folder, leaves the model's
logits untouched, and refuses broken heads with clear messages."""

import json
import logging
import shutil

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from click.testing import CliRunner

from mlxmtp.checkpoint import hf_head, mtp_folder
from mlxmtp.commands.main import main as cli
from mlxmtp.engine.config import EngineConfig
from mlxmtp.models.errors import MissingMTPHeadError, MTPLoadError
from mlxmtp.models.load import load
from mlxmtp.testing.fixtures import FAMILIES, write_hf_checkpoint


def rms(x, w, eps=1e-6, zero_centred=True):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y * ((1.0 + w) if zero_centred else w)


def rope(x, rot, theta):
    """Rotate-half RoPE on the first `rot` dims; x [T, heads, d], positions 0..T-1."""
    T = x.shape[0]
    half = rot // 2
    inv = theta ** (-np.arange(half) * 2.0 / rot)
    ang = np.arange(T)[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)


def silu(x):
    return x / (1 + np.exp(-x))


def reference_head(t, cfg, emb, hid):
    """The head's math (shared docs section 3) from raw HF `mtp.*` tensors, in numpy."""
    g = lambda n: t[f"mtp.{n}"]  # noqa: E731
    eps = cfg["rms_norm_eps"]
    x = np.concatenate([rms(emb, g("pre_fc_norm_embedding.weight"), eps),
                        rms(hid, g("pre_fc_norm_hidden.weight"), eps)], -1) @ g("fc.weight").T
    T, nh, nkv, hd = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    a = "layers.0.self_attn."
    h = rms(x, g("layers.0.input_layernorm.weight"), eps)
    qg = (h @ g(a + "q_proj.weight").T).reshape(T, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = (h @ g(a + "k_proj.weight").T).reshape(T, nkv, hd)
    v = (h @ g(a + "v_proj.weight").T).reshape(T, nkv, hd)
    q, k = rms(q, g(a + "q_norm.weight"), eps), rms(k, g(a + "k_norm.weight"), eps)
    rot = int(hd * cfg["partial_rotary_factor"])
    q, k = rope(q, rot, cfg["rope_theta"]), rope(k, rot, cfg["rope_theta"])
    k, v = np.repeat(k, nh // nkv, 1), np.repeat(v, nh // nkv, 1)
    s = np.einsum("thd,shd->hts", q, k) * hd**-0.5
    s = s + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", p, v).reshape(T, nh * hd)
    x = x + (o * (1 / (1 + np.exp(-gate.reshape(T, nh * hd))))) @ g(a + "o_proj.weight").T
    h = rms(x, g("layers.0.post_attention_layernorm.weight"), eps)
    m = "layers.0.mlp."

    def swiglu(hh, gw, uw, dw):
        return (silu(hh @ gw.T) * (hh @ uw.T)) @ dw.T

    if f"mtp.{m}gate.weight" not in t:
        y = swiglu(h, g(m + "gate_proj.weight"), g(m + "up_proj.weight"), g(m + "down_proj.weight"))
    else:
        logits = h @ g(m + "gate.weight").T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        E = probs.shape[-1]
        if f"mtp.{m}experts.gate_up_proj" in t:
            gu, down = g(m + "experts.gate_up_proj"), g(m + "experts.down_proj")
            mid = gu.shape[1] // 2
            experts = [(gu[e, :mid], gu[e, mid:], down[e]) for e in range(E)]
        else:
            experts = [tuple(g(f"{m}experts.{e}.{n}_proj.weight") for n in ("gate", "up", "down")) for e in range(E)]
        y = np.zeros_like(h)
        for i in range(T):
            top = np.argsort(-probs[i])[: cfg["num_experts_per_tok"]]
            w = probs[i, top]
            if cfg.get("norm_topk_prob", cfg["_family"] != "qwen3_next"):
                w = w / w.sum()
            for e, we in zip(top, w):
                y[i] += we * swiglu(h[i], *experts[e])
        shared = swiglu(h, g(m + "shared_expert.gate_proj.weight"), g(m + "shared_expert.up_proj.weight"),
                        g(m + "shared_expert.down_proj.weight"))
        y = y + (1 / (1 + np.exp(-(h @ g(m + "shared_expert_gate.weight").T)))) * shared
    return rms(x + y, g("norm.weight"), eps)


def hf_tensors(path):
    out = {}
    for k, v in hf_head.load_mtp_tensors(path).items():
        out[k] = np.array(v.astype(mx.float32))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_head_matches_plain_reference(fixture_model, family):
    path = fixture_model(family)["hf"]
    model, _ = load(str(path))
    cfg = json.loads((path / "config.json").read_text())
    tcfg = dict(cfg.get("text_config", cfg), _family=cfg["model_type"])
    if "rope_parameters" in tcfg:
        tcfg.setdefault("partial_rotary_factor", tcfg["rope_parameters"].get("partial_rotary_factor", 0.25))
        tcfg.setdefault("rope_theta", tcfg["rope_parameters"].get("rope_theta", 1e5))
    rng = np.random.default_rng(0)
    H = tcfg["hidden_size"]
    emb = rng.normal(size=(7, H)).astype(np.float32)
    hid = rng.normal(size=(7, H)).astype(np.float32)
    got = np.array(model.head(mx.array(emb)[None], mx.array(hid)[None]))[0]
    want = reference_head(hf_tensors(path), tcfg, emb, hid)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_identical_to_stock_mlx_lm(fixture_model, family):
    path = str(fixture_model(family)["hf"])
    model, _ = load(path)
    stock, _ = mlx_lm.load(path)
    x = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert model.active
    assert mx.array_equal(model(x), stock(x)).item()


def test_load_returns_the_untouched_mlx_lm_model_with_its_head(fixture_model):
    """load() gives an MTPModel: the mlx-lm model itself (nothing attached to it, the same
    parameters as stock mlx-lm's), the head and the engines' shared state beside it; mlx-lm's
    own generation takes it as it takes the model."""
    from mlx.utils import tree_flatten

    from mlxmtp.models.mtp_model import MTPModel

    path = str(fixture_model("qwen3_5")["hf"])
    model, tok = load(path)
    stock, _ = mlx_lm.load(path)
    assert isinstance(model, MTPModel) and model.active and model.policies == {}
    assert not hasattr(model.base, "mtp") and not hasattr(model.base, "head")
    mine, theirs = dict(tree_flatten(model.base.parameters())), dict(tree_flatten(stock.parameters()))
    assert mine.keys() == theirs.keys() and all(mx.array_equal(mine[k], theirs[k]).item() for k in mine)
    prompt = tok.encode("def f(x):")
    a = mlx_lm.generate(model, tok, prompt, max_tokens=8)
    assert a == mlx_lm.generate(stock, tok, prompt, max_tokens=8)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_tied", "qwen3_6_moe"])
def test_hf_and_mtp_folder_give_identical_heads(fixture_model, tmp_path, family):
    paths = fixture_model(family)
    target = tmp_path / "mlx"
    shutil.copytree(paths["mlx_8bit"], target)
    weights, info = hf_head.convert_hf_head(hf_head.load_mtp_tensors(paths["hf"]))
    cfg = mtp_folder.make_head_config(source=str(paths["hf"]), family=family, info=info, quantization=None,
                                      dtype="float32")
    mtp_folder.write_mtp_folder(target, cfg, weights)
    a, _ = load(str(paths["hf"]))
    b, _ = load(str(target))
    assert b.source.location == "mtp_folder"
    rng = np.random.default_rng(1)
    e, h = (mx.array(rng.normal(size=(1, 5, 64)).astype(np.float32)) for _ in range(2))
    assert mx.array_equal(a.head(e, h), b.head(e, h)).item()
    # The injected folder still loads in stock mlx-lm.
    mlx_lm.load(str(target))


def test_missing_head_names_the_repair_command(tmp_path):
    path = write_hf_checkpoint(tmp_path / "nohead", "qwen3_5", with_mtp=False)
    with pytest.raises(MissingMTPHeadError, match="mlxmtp add-mtp-weights"):
        load(str(path))
    model, _ = load(str(path), mtp_fallback=True)
    assert not model.active and "add-mtp-weights" in model.disabled_reason
    res = CliRunner().invoke(cli, ["generate", "--model", str(path), "--prompt", "hi", "-m", "3"])
    assert res.exit_code != 0 and "mlxmtp add-mtp-weights" in res.output


def test_mismatched_head_shapes_refused(fixture_model, tmp_path):
    small = fixture_model("qwen3_5")
    other = write_hf_checkpoint(tmp_path / "wide", "qwen3_5", hidden_size=128)
    target = tmp_path / "mlx"
    shutil.copytree(small["mlx_4bit"], target)
    weights, info = hf_head.convert_hf_head(hf_head.load_mtp_tensors(other))
    cfg = mtp_folder.make_head_config(source=str(other), family="qwen3_5", info=info, quantization=None,
                                      dtype="float32")
    mtp_folder.write_mtp_folder(target, cfg, weights)
    with pytest.raises(MTPLoadError, match="does not match this model"):
        load(str(target))


def test_inspect_json(fixture_model):
    paths = fixture_model("qwen3_6_moe")
    out = CliRunner().invoke(cli, ["inspect", str(paths["hf"]), "--json"])
    info = json.loads(out.output)
    assert info["family"] == "qwen3_5_moe" and info["quantization"] is None
    assert info["mtp"] | {} and info["mtp"]["present"] is True
    assert info["mtp"]["layers"] == 1 and info["mtp"]["expert_layout"] == "fused"
    assert info["mtp"]["hidden_state"] == "post_norm" and info["mtp"]["location"]
    q = json.loads(CliRunner().invoke(cli, ["inspect", str(paths["mlx_4bit"]), "--json"]).output)
    assert q["quantization"]["bits"] == 4 and q["mtp"]["present"] is False


def test_pre_norm_switch_feeds_the_backbone_input_of_the_final_norm(fixture_model):
    from mlxmtp.engine.generate import generate
    from mlxmtp.mlxlm import adapter

    path = str(fixture_model("qwen3_5")["hf"])
    post, tok = load(path)
    pre, _ = load(path, hidden_state="pre_norm")
    x = mx.array([[5, 6, 7, 8]])
    lp, hp = adapter.forward(pre.parts, x, None, "pre_norm")
    lq, hq = adapter.forward(post.parts, x, None, "post_norm")
    assert mx.array_equal(lp, lq).item()  # logits unchanged by the switch
    # post-norm = final_norm(pre-norm): the switch really hands the head the norm's input
    assert mx.allclose(pre.parts.backbone.norm(hp), hq, atol=1e-5).item()
    assert not mx.allclose(hp, hq).item()
    prompt = [1, 2, 3, 4, 5]
    a = generate(pre, tok, prompt, max_tokens=30, config=EngineConfig(num_draft=2)).token_ids
    b = generate(post, tok, prompt, max_tokens=30, config=EngineConfig(enable_mtp=False)).token_ids
    assert a == b


def test_load_wires_the_recommended_working_set_where_the_device_has_one(fixture_model, monkeypatch, caplog):
    # Apple GPUs report a recommended working set; mlx-lm's server and generate wire it so
    # that macOS keeps a large model's weights resident. The CPU and CUDA report none.
    caplog.set_level(logging.WARNING, logger="mlxmtp")
    path = str(fixture_model("qwen3_5")["hf"])
    wired = []
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: wired.append(n) or 0)
    load(path)
    assert wired == [] and "max_recommended_working_set_size" not in mx.device_info()
    real_info = mx.device_info
    for size, warned in ((64 << 30, False), (1 << 19, True)):  # the fixture's weights: ~0.8 MiB
        monkeypatch.setattr(mx, "device_info", lambda size=size: {**real_info(),
                                                                   "max_recommended_working_set_size": size})
        caplog.clear()
        load(path)
        assert wired[-1] == size
        assert ("close to the device's recommended working set" in caplog.text) == warned, caplog.text
