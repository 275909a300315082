"""`mlxmtp add-mtp-weights`: repair quantized MLX conversions that dropped the MTP head."""

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

from mlxmtp.checkpoint import hf_head, mtp_folder
from mlxmtp.commands.add_mtp_weights import add_mtp_weights as cli
from mlxmtp.convert import add_mtp_weights as amw
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.generate import generate
from mlxmtp.mlxlm.family import text_parts
from mlxmtp.models import attach, errors, head_build, head_source
from mlxmtp.models import load as L
from mlxmtp.testing import fixtures as fx

CASES = [(name, bits) for name in fx.FAMILIES for bits in (4, 8)]
# Head output h' (after mtp.norm, RMS ~1) of the repaired quantized head vs the HF fp32 head,
# same inputs: relative L2 error. Measured on the fixtures (3 seeds): 4-bit 0.13-0.18,
# 8-bit 0.008 (dense) / 0.02-0.04 (MoE: a few routing flips).
REL_TOL = {4: 0.25, 8: 0.06}
# Argmax agreement of lm_head(h') between repaired and HF heads on 256 random positions: the
# acceptance the repaired head would get if the HF head were always right.
# Measured: 4-bit 0.75-0.86 (hidden 64, one group per row: harsher than real models), 8-bit 0.98-1.00.
AGREE_MIN = {4: 0.70, 8: 0.95}
PROMPT = "The quick brown fox jumps over the lazy dog and then the dog"
# Above any PID a Linux or macOS kernel hands out: the run that named a folder so is over.
DEAD_PID = 4194311


def _run(*args):
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return res


def _repair(target, source, *extra):
    res = _run("--model", target, "--source", source, *extra)
    assert res.exit_code == 0, res.output
    return res


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def _no_half_head(folder: Path):
    assert not (folder / "mtp").exists()
    assert not list(folder.glob(".mtp-*"))
    assert head_source.locate_head(folder) is None


_HF = {}


def _hf_model(path: Path):
    """HF fp32 checkpoint loaded with its head (cached per path)."""
    if str(path) not in _HF:
        _HF[str(path)] = L.load(str(path))
    return _HF[str(path)]


def _head_inputs(parts, seed=0, B=4, T=64):
    mx.random.seed(seed)
    H = parts.args.hidden_size
    V = parts.embed_tokens.weight.shape[0]
    tokens = mx.random.randint(0, min(V, fx.tokenizer_size() - 9), (B, T))
    # The same embeddings and hidden states for both heads.
    hidden = mx.random.normal((B, T, H))
    return tokens, hidden


@pytest.mark.slow
@pytest.mark.parametrize("name,bits", CASES)
def test_repair_family(tmp_path, fixture_models, name, bits):
    hf = fixture_models[name]["hf"]
    target = _copy(fixture_models[name][f"mlx_{bits}bit"], tmp_path / "mlx")
    before = _snapshot(target)
    model0, tok = mlx_lm.load(str(target))
    prompt = tok.encode(PROMPT)
    logits0 = model0(mx.array([prompt]))

    res = _repair(target, hf)
    assert f"{bits}-bit" in res.output and "shards to read" in res.output
    # The model's own files are untouched; only mtp/ was added.
    after = _snapshot(target)
    assert {k: v for k, v in after.items() if not k.startswith("mtp")} == before
    assert set(after) - set(before) == {"mtp", "mtp/config.json", "mtp/weights.safetensors"}

    # (a) stock mlx-lm still loads it, logits unchanged.
    model1, _ = mlx_lm.load(str(target))
    assert mx.array_equal(model1(mx.array([prompt])), logits0).item()

    # (b) mlxmtp.load attaches a quantized head, quantized like the model.
    model, tok = L.load(str(target))
    att = model
    assert att.active and att.source.location == "mtp_folder"
    head = att.head
    assert isinstance(head.fc, nn.QuantizedLinear) and head.fc.bits == bits
    assert head.layers[0].self_attn.q_proj.bits == bits
    cfg = json.loads((target / "mtp" / "config.json").read_text())
    assert cfg["quantization"]["bits"] == bits and cfg["norms_shifted"] is True
    moe = fx.FAMILIES[name]["family"] != "qwen3_5"
    if moe:
        mlp = head.layers[0].mlp
        assert mlp.switch_mlp.gate_proj.bits == bits
        # Router and shared_expert_gate like mlx-lm quantizes the main layers: 8-bit group 64.
        assert (mlp.gate.bits, mlp.gate.group_size) == (8, 64)
        assert (mlp.shared_expert_gate.bits, mlp.shared_expert_gate.group_size) == (8, 64)
        assert cfg["quantization"]["layers.0.mlp.gate"]["bits"] == 8
        assert cfg["num_experts"] == fx.DEFAULT_SIZES["num_experts"]

    # (c) head output close to the HF-loaded head's on identical inputs.
    hf_model, _ = _hf_model(hf)
    hf_parts = hf_model.parts
    tokens, hidden = _head_inputs(hf_parts)
    emb = hf_parts.embed_tokens(tokens)
    ref = hf_model.head(emb, hidden)
    out = head(emb, hidden)
    rel = (mx.linalg.norm(out - ref) / mx.linalg.norm(ref)).item()
    assert rel < REL_TOL[bits], rel
    # Argmax agreement through the same (HF) lm_head: what acceptance depends on.
    agree = mx.mean(hf_parts.lm_head(out).argmax(-1) == hf_parts.lm_head(ref).argmax(-1)).item()
    assert agree >= AGREE_MIN[bits], agree

    # (d) greedy generation with MTP equals without; acceptance close to the HF head's.
    on = generate(model, tok, prompt, max_tokens=40, config=EngineConfig(enable_mtp=True, num_draft=2))
    off = generate(model, tok, prompt, max_tokens=40, config=EngineConfig(enable_mtp=False))
    assert on.token_ids == off.token_ids
    acc = on.stats.as_dict()["acceptance"]
    hf_acc = generate(hf_model, tok, prompt, max_tokens=40,
                      config=EngineConfig(enable_mtp=True, num_draft=2)).stats.as_dict()["acceptance"]
    # Random fixture heads: both near 0; the main models differ (quantized vs fp32) too.
    assert abs(acc - hf_acc) <= 0.2, (acc, hf_acc)
    # The same quantized model with the unquantized HF head: isolates head quantization.
    same, _ = mlx_lm.load(str(target))
    attach.attach_mtp(same, hf)
    ref_acc = generate(same, tok, prompt, max_tokens=40,
                       config=EngineConfig(enable_mtp=True, num_draft=2)).stats.as_dict()["acceptance"]
    assert abs(acc - ref_acc) <= 0.15, (acc, ref_acc)


def test_conversion_matches_hf_head_exactly_bits16(tmp_path):
    """--bits 16 keeps the source dtype unquantized, bit-identical to convert_hf_head."""
    hf = fx.write_hf_checkpoint(tmp_path / "hf", "qwen3_5_moe", dtype="bfloat16", expert_layout="fused")
    target = fx.write_mlx_conversion(hf, tmp_path / "mlx", bits=4)
    res = _repair(target, hf, "--bits", "16")
    assert "quantization: none" in res.output
    cfg, weights = mtp_folder.read_mtp_folder(target)
    assert cfg["quantization"] is None and cfg["dtype"] == "bfloat16"
    assert not any(k.endswith(".scales") for k in weights)
    expected, _ = hf_head.convert_hf_head(hf_head.load_mtp_tensors(hf))
    assert set(weights) == set(expected)
    for k, v in expected.items():
        assert weights[k].dtype == mx.bfloat16, k
        assert mx.array_equal(weights[k], v).item(), k
    model, tok = L.load(str(target))
    assert type(model.head.fc) is nn.Linear
    # Stored bf16 (above); on the CPU the loader computes the head in float32 (faster there).
    assert model.head.fc.weight.dtype == (mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16)


def test_per_expert_bf16_chunked_matches(tmp_path, monkeypatch):
    """Experts stacked in several chunks give exactly the one-shot stack (+ quantize)."""
    monkeypatch.setattr(amw, "CHUNK_BYTES", 3 * 64 * 64 * 2)  # 3 experts per chunk
    hf = fx.write_hf_checkpoint(tmp_path / "hf", "qwen3_next", dtype="bfloat16")
    target = fx.write_mlx_conversion(hf, tmp_path / "mlx", bits=4)
    amw.add_mtp_weights(target, str(hf), echo=lambda s: None)
    _, weights = mtp_folder.read_mtp_folder(target)
    expected, _ = hf_head.convert_hf_head(hf_head.load_mtp_tensors(hf))
    w = expected["layers.0.mlp.switch_mlp.up_proj.weight"]
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    assert mx.array_equal(weights["layers.0.mlp.switch_mlp.up_proj.weight"], q).item()
    assert mx.array_equal(weights["layers.0.mlp.switch_mlp.up_proj.scales"], s).item()
    assert mx.array_equal(weights["layers.0.mlp.switch_mlp.up_proj.biases"], b).item()
    assert mx.array_equal(weights["norm.weight"], expected["norm.weight"]).item()


def _refused(target, source, *words):
    before = _snapshot(target)
    res = _run("--model", target, "--source", source)
    assert res.exit_code != 0, res.output
    for w in words:
        assert w in res.output, res.output
    assert _snapshot(target) == before
    _no_half_head(target)
    return res


def test_refuses_other_family(tmp_path, fixture_models):
    target = _copy(fixture_models["qwen3_next"]["mlx_4bit"], tmp_path / "mlx")
    _refused(target, fixture_models["qwen3_5"]["hf"], "qwen3_5", "qwen3_next", "nothing written")


def test_refuses_other_hidden_size(tmp_path, fixture_models):
    src = fx.write_hf_checkpoint(tmp_path / "h128", "qwen3_next", hidden_size=128)
    target = _copy(fixture_models["qwen3_next"]["mlx_4bit"], tmp_path / "mlx")
    _refused(target, src, "hidden_size: source 128, target 64")


def test_refuses_other_expert_count(tmp_path, fixture_models):
    # A pruned model: same everything but 6 experts in the source.
    src = fx.write_hf_checkpoint(tmp_path / "pruned", "qwen3_next", num_experts=6)
    target = _copy(fixture_models["qwen3_next"]["mlx_8bit"], tmp_path / "mlx")
    _refused(target, src, "num_experts: source 6, target 8")
    # Config lies (says 8) but the tensors hold 6: caught from the tensors.
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_experts"] = 8
    (src / "config.json").write_text(json.dumps(cfg))
    _refused(target, src, "source head has 6 experts, target model 8")


def test_refuses_other_dtype(tmp_path, fixture_models):
    src = fx.write_hf_checkpoint(tmp_path / "bf16", "qwen3_5", dtype="bfloat16")
    target = _copy(fixture_models["qwen3_5"]["mlx_4bit"], tmp_path / "mlx")  # float32 model
    _refused(target, src, "dtype: source head is bfloat16, target model float32")


def test_refuses_double_shifted_source(tmp_path, fixture_models):
    src = _copy(fixture_models["qwen3_5"]["hf"], tmp_path / "hf")
    for shard in sorted(set(hf_head.mtp_tensor_files(src).values())):
        tensors = mx.load(str(src / shard))
        tensors = {k: (v + 1.0 if k.startswith("mtp.") and hf_head.is_zero_centred_norm(k[4:]) else v)
                   for k, v in tensors.items()}
        mx.save_safetensors(str(src / shard), tensors, metadata={"format": "pt"})
    target = _copy(fixture_models["qwen3_5"]["mlx_4bit"], tmp_path / "mlx")
    _refused(target, src, "already shifted")


def test_refuses_source_without_head(tmp_path, fixture_models):
    target = _copy(fixture_models["qwen3_5"]["mlx_4bit"], tmp_path / "mlx")
    _refused(target, fixture_models["qwen3_5"]["mlx_8bit"], "no mtp.* tensors")


def test_head_present_is_noop_unless_force(tmp_path, fixture_models):
    hf = fixture_models["qwen3_5_moe"]["hf"]
    target = _copy(fixture_models["qwen3_5_moe"]["mlx_4bit"], tmp_path / "mlx")
    _repair(target, hf)
    before = _snapshot(target)
    res = _repair(target, hf)
    assert "already has an MTP head" in res.output and "nothing to do" in res.output
    assert _snapshot(target) == before
    res = _repair(target, hf, "--force", "--bits", "8")
    assert "wrote" in res.output
    cfg, _ = mtp_folder.read_mtp_folder(target)
    assert cfg["quantization"]["bits"] == 8
    assert not list(target.glob(".mtp-*"))
    model, _ = L.load(str(target))
    assert model.head.fc.bits == 8
    # mtp.* in the model's own shards counts as a head too.
    hf_copy = _copy(hf, tmp_path / "hf")
    before = _snapshot(hf_copy)
    res = _repair(hf_copy, hf)
    assert "already has an MTP head" in res.output and "mtp.* tensors" in res.output
    assert _snapshot(hf_copy) == before


@pytest.mark.parametrize("where", ["save", "replace"])
def test_kill_during_write_leaves_no_half_head(tmp_path, fixture_models, monkeypatch, where):
    hf = fixture_models["qwen3_next"]["hf"]
    target = _copy(fixture_models["qwen3_next"]["mlx_4bit"], tmp_path / "mlx")
    before = _snapshot(target)

    if where == "save":
        def boom(path, *a, **k):
            Path(path).write_bytes(b"half a safetensors file")
            raise KeyboardInterrupt("killed")

        monkeypatch.setattr(mtp_folder.mx, "save_safetensors", boom)
    else:
        real = os.replace

        def boom(src, dst):
            if Path(dst).name == "mtp":
                raise KeyboardInterrupt("killed")
            return real(src, dst)

        monkeypatch.setattr(mtp_folder.os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        amw.add_mtp_weights(target, str(hf), echo=lambda s: None)
    monkeypatch.undo()
    assert _snapshot(target) == before
    _no_half_head(target)
    mlx_lm.load(str(target))
    with pytest.raises(errors.MissingMTPHeadError):
        L.load(str(target))
    # A real SIGKILL skips the cleanup: the stale temp folder is invisible to both loaders
    # and the next run removes it.
    stale = target / f".mtp-tmp-{DEAD_PID}-killed"
    stale.mkdir()
    (stale / "weights.safetensors").write_bytes(b"half")
    assert head_source.locate_head(target) is None
    mlx_lm.load(str(target))
    _repair(target, hf)
    assert not stale.exists()
    assert L.load(str(target))[0].active


def test_hf_id_from_offline_cache(tmp_path, fixture_models, monkeypatch):
    import huggingface_hub.constants as hfc

    hf = fixture_models["qwen3_6_moe"]["hf"]
    needed = sorted(set(hf_head.mtp_tensor_files(hf).values()))
    all_shards = sorted(p.name for p in hf.glob("*.safetensors"))
    assert len(needed) < len(all_shards)
    cache = tmp_path / "hub"
    repo = cache / "models--fake-org--Qwen3.6-tiny"
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    # Only config, index and the shards with the head: the other shard must not be needed.
    for f in ["config.json", "model.safetensors.index.json", *needed]:
        shutil.copy(hf / f, snap / f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hfc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hfc, "HF_HUB_CACHE", str(cache))

    target = _copy(fixture_models["qwen3_6_moe"]["mlx_4bit"], tmp_path / "mlx")
    res = _repair(target, "fake-org/Qwen3.6-tiny")
    assert ", ".join(needed) in res.output
    cfg, _ = mtp_folder.read_mtp_folder(target)
    assert cfg["source"] == "fake-org/Qwen3.6-tiny" and cfg["expert_layout"] == "fused"
    model, tok = L.load(str(target))
    assert model.active
    # A repo that is not cached fails cleanly offline.
    other = _copy(fixture_models["qwen3_6_moe"]["mlx_4bit"], tmp_path / "mlx2")
    res = _run("--model", other, "--source", "fake-org/not-cached")
    assert res.exit_code != 0 and "cannot fetch fake-org/not-cached" in res.output
    _no_half_head(other)


def test_dry_run_writes_nothing(tmp_path, fixture_models):
    hf = fixture_models["qwen3_5_moe"]["hf"]
    target = _copy(fixture_models["qwen3_5_moe"]["mlx_4bit"], tmp_path / "mlx")
    before = _snapshot(target)
    res = _repair(target, hf, "--dry-run")
    for shard in sorted(set(hf_head.mtp_tensor_files(hf).values())):
        assert shard in res.output
    assert "mtp.fc.weight" in res.output and "4-bit, group size 64" in res.output
    assert "layers.0.mlp.gate 8-bit group 64" in res.output and "nothing written" in res.output
    assert _snapshot(target) == before
    _no_half_head(target)


def test_quantization_dict_rebuilds_shapes(tmp_path, fixture_models):
    """The recorded dict alone (no peeking at scales) gives the saved shapes via quantize_like."""
    target = _copy(fixture_models["qwen3_6_moe"]["mlx_4bit"], tmp_path / "mlx")
    _repair(target, fixture_models["qwen3_6_moe"]["hf"], "--group-size", "32")
    cfg, weights = mtp_folder.read_mtp_folder(target)
    q = cfg["quantization"]
    assert q["group_size"] == 32 and q["layers.0.mlp.gate"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    model, _ = mlx_lm.load(str(target))
    head = head_build.build_head(text_parts(model), weights, cfg, q)
    shapes = {k: v.shape for k, v in tree_flatten(head.parameters())}
    assert shapes == {k: v.shape for k, v in weights.items()}
    assert head.fc.group_size == 32 and head.layers[0].mlp.gate.group_size == 64


def test_mtp_folder_is_readable_like_the_model_files(tmp_path):
    # mkdtemp makes the staging folder private (0700); a model folder read by another user
    # (a shared cache, a container) must be able to read the head too.
    umask = os.umask(0o022)
    try:
        info = {"num_layers": 1, "expert_layout": "dense", "num_experts": 0, "moe": False}
        cfg = mtp_folder.make_head_config(source="x", family="qwen3_5", info=info, quantization=None, dtype="float32")
        mtp_folder.write_mtp_folder(tmp_path, cfg, {"fc.weight": mx.zeros((2, 4))})
    finally:
        os.umask(umask)
    assert (tmp_path / "mtp").stat().st_mode & 0o777 == 0o755


def test_the_demo_repairs_a_quantized_copy_of_itself_offline(tmp_path, monkeypatch):
    """`--source mlxmtp-demo`: the demo's own head in HF layout, exported from the package
    (no network: the Hub is switched off here). A float16 copy gets the shipped head back
    bit for bit; a 4-bit conversion (mlx_lm.convert -q drops mtp.*) a 4-bit head that loads."""
    import huggingface_hub.constants as hfc

    from mlxmtp.models import demo

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hfc, "HF_HUB_OFFLINE", True)
    copy = _copy(demo.PACKAGED, tmp_path / "demo-float16")
    shutil.rmtree(copy / "mtp")
    _repair(copy, "mlxmtp-demo", "--bits", "16")
    cfg, weights = mtp_folder.read_mtp_folder(copy)
    shipped_cfg, shipped = mtp_folder.read_mtp_folder(demo.PACKAGED)
    assert cfg["source"] == "mlxmtp-demo" and cfg["dtype"] == shipped_cfg["dtype"] == "float16"
    assert sorted(weights) == sorted(shipped)
    assert all(mx.array_equal(weights[k], shipped[k]).item() and weights[k].dtype == shipped[k].dtype
               for k in shipped)

    q4 = fx.write_mlx_conversion(demo.PACKAGED, tmp_path / "demo-4bit", bits=4)
    assert head_source.locate_head(q4) is None
    res = _repair(q4, "mlxmtp-demo")
    assert "source:  mlxmtp-demo ->" in res.output and "4-bit" in res.output
    cfg, _ = mtp_folder.read_mtp_folder(q4)
    assert cfg["quantization"]["bits"] == 4 and cfg["source"] == "mlxmtp-demo"
    model, _ = L.load(str(q4), mtp=True)
    assert model.active and model.source.location == "mtp_folder"
    assert not list(tmp_path.glob(".mtp-*"))
    res = _run("--model", tmp_path / "demo-float16", "--source", "mlxmtp-demo", "--revision", "main", "--force")
    assert res.exit_code != 0 and "--revision applies to a Hugging Face repo id only" in res.output
