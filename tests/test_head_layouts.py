"""Heads other tools leave in MLX folders load as they are (models/head_layouts.py): a
sidecar file beside the shards, listed in the index or not; MLX-quantized layers whose
bits and group size only their widths tell; norms shifted already or not; MTPHead or HF
names. Each loads into the very parameters of the head it was made from."""

import json
import re
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from engine_helpers import hub_from_folder
from mlx.utils import tree_flatten

from mlxmtp.checkpoint import hf_head, mtp_folder
from mlxmtp.engine.config import EngineConfig
from mlxmtp.mlxlm.family import text_parts
from mlxmtp.models.demo import demo_model_path
from mlxmtp.models.errors import MTPLoadError
from mlxmtp.models.load import load
from mlxmtp.models.mtp_head import MTPHead


def _params(module) -> dict:
    return {k: np.array(v.astype(mx.float32) if v.dtype != mx.uint32 else v) for k, v in tree_flatten(module.parameters())}


def _assert_same_params(got, want):
    got, want = _params(got), _params(want)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _demo_without_head(tmp_path):
    folder = tmp_path / "demo"
    shutil.copytree(demo_model_path(), folder, ignore=shutil.ignore_patterns(mtp_folder.FOLDER))
    return folder


def _quantize(module, bits_of) -> dict:
    """`module` quantized layer by layer (`bits_of(path)`: bits, None to leave it), as
    {path: (bits, group size)}."""
    chosen = {}

    def pick(path, m):
        bits = bits_of(path) if isinstance(m, (nn.Linear, nn.QuantizedLinear)) or hasattr(m, "to_quantized") else None
        if bits:
            chosen[path] = bits
            return {"group_size": 32, "bits": bits}
        return False

    nn.quantize(module, class_predicate=pick)
    return chosen


def _unshift(name: str, w: mx.array) -> mx.array:
    return w - 1.0 if hf_head.is_zero_centred_norm(name) else w


def test_a_head_an_mlx_conversion_kept_in_an_indexed_shard(tmp_path):
    """mtp.* tensors in MTPHead names with shifted norms (an mlx-lm conversion that keeps
    the head), in a model-mtp.safetensors the index lists."""
    demo, _ = load(None)
    folder = _demo_without_head(tmp_path)
    weights = mx.load(str(demo_model_path() / mtp_folder.FOLDER / mtp_folder.WEIGHTS))
    mx.save_safetensors(str(folder / "model-mtp.safetensors"), {f"mtp.{k}": v for k, v in weights.items()})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"].update({f"mtp.{k}": "model-mtp.safetensors" for k in weights})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    model, _ = load(str(folder))
    assert model.active and model.source.location == "hf_checkpoint"
    _assert_same_params(model.head, demo.head)


@pytest.mark.slow
def test_a_quantized_sidecar_with_raw_norms_beside_an_index(tmp_path):
    """An MTPLX-style `mtp.safetensors` the index does not list: HF names, norms not
    shifted, linear layers MLX-quantized at 4 bits and the fc at 8."""
    demo, _ = load(None)
    reference = demo.head
    _quantize(reference, lambda path: 8 if path == "fc" else 4)
    folder = _demo_without_head(tmp_path)
    flat = dict(tree_flatten(reference.parameters()))
    mx.save_safetensors(str(folder / "mtp.safetensors"), {f"mtp.{k}": _unshift(k, v) for k, v in flat.items()})
    model, tok = load(str(folder))
    assert model.active
    _assert_same_params(model.head, reference)
    assert model.head.fc.bits == 8 and model.head.layers[0].self_attn.q_proj.bits == 4
    # It drafts: greedy text as with MTP off, most drafts kept (the demo's head is trained).
    from mlxmtp.engine.generate import generate
    from mlxmtp.models.demo_prompts import HELD_OUT_PROMPTS

    ids = tok.encode(next(iter(HELD_OUT_PROMPTS.values())))
    on = generate(model, tok, ids, max_tokens=48, config=EngineConfig(enable_mtp=True, num_draft=2))
    assert on.token_ids == generate(model, tok, ids, max_tokens=48, config=EngineConfig(enable_mtp=False)).token_ids
    assert on.stats.as_dict()["acceptance"] > 0.5


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next", "qwen3_6_moe"])
def test_quantized_hf_named_tensors_in_another_runtimes_mtp_folder(fixture_model, tmp_path, family):
    """HF-named tensors in mtp/weights.safetensors beside a config.json that is not
    mlxmtp's (another runtime's sidecar folder): every 2-D layer quantized on its own (the
    router at 8 bits, the rest at 4; per-expert layers expert by expert, stacked as they
    are), a fused expert tensor left unquantized (Qwen3.6)."""
    paths = fixture_model(family)
    tensors = hf_head.load_mtp_tensors(paths["hf"])
    head_bits, quantized = {}, {}  # MTPHead layer path -> bits; the tensors written
    for name, w in tensors.items():
        if w.ndim == 2 and not name.endswith("norm.weight"):
            path = name[: -len(".weight")]
            bits = 8 if path.endswith("mlp.gate") else 4
            q, scales, biases = mx.quantize(w, group_size=32, bits=bits)
            quantized.update({f"{path}.weight": q, f"{path}.scales": scales, f"{path}.biases": biases})
            head_bits[re.sub(r"experts\.\d+\.", "switch_mlp.", path.removeprefix("mtp."))] = bits
        else:
            quantized[name] = w
    target = tmp_path / "mlx"
    shutil.copytree(paths["mlx_4bit"], target)
    (target / mtp_folder.FOLDER).mkdir()
    mx.save_safetensors(str(target / mtp_folder.FOLDER / mtp_folder.WEIGHTS), quantized)
    (target / mtp_folder.FOLDER / mtp_folder.CONFIG).write_text(json.dumps({"runtime": "another"}))
    model, _ = load(str(target))
    weights, info = hf_head.convert_hf_head(tensors)
    reference = MTPHead(text_parts(model.base), num_layers=info["num_layers"], moe=info["moe"])
    reference.load_weights(list(weights.items()))
    _quantize(reference, head_bits.get)
    _assert_same_params(model.head, reference)


def test_norms_shifted_already_are_read_as_shifted_and_half_shifted_ones_refused(fixture_model, tmp_path):
    hf = fixture_model("qwen3_5")["hf"]
    model, _ = load(str(hf))
    for half in (False, True):
        target = tmp_path / f"half-{half}"
        shutil.copytree(hf, target)
        for shard in target.glob("*.safetensors"):
            t = dict(mx.load(str(shard)))
            norms = sorted(k for k in t if k.startswith("mtp.") and hf_head.is_zero_centred_norm(k[4:]))
            for k in norms[: len(norms) // 2] if half else norms:
                t[k] = t[k] + 1.0
            mx.save_safetensors(str(shard), t, metadata={"format": "pt"})
        if half:
            with pytest.raises(MTPLoadError, match="shifted twice"):
                load(str(target))
        else:
            _assert_same_params(load(str(target))[0].head, model.head)


def test_a_kept_head_whose_norms_drifted_in_training_is_read_as_shifted(fixture_model, tmp_path):
    """A head shifted already, one of whose norms sits half a unit below the model's final
    norm (a trained head's norms drift): shifted again, the others would sit ~1 above it and
    that one ~0.5, so the head as a whole says it was shifted."""
    hf = fixture_model("qwen3_5")["hf"]
    target = tmp_path / "drifted"
    shutil.copytree(hf, target)
    drifted = "mtp.layers.0.post_attention_layernorm.weight"
    for shard in target.glob("*.safetensors"):
        t = dict(mx.load(str(shard)))
        for k in [k for k in t if k.startswith("mtp.") and hf_head.is_zero_centred_norm(k[4:])]:
            t[k] = t[k] + (0.5 if k == drifted else 1.0)
        mx.save_safetensors(str(shard), t, metadata={"format": "pt"})
    head = load(str(target))[0].head
    want = load(str(hf))[0].head.layers[0].post_attention_layernorm.weight - 0.5
    np.testing.assert_allclose(np.array(head.layers[0].post_attention_layernorm.weight, dtype=np.float32),
                               np.array(want, dtype=np.float32), atol=1e-3)


def _set_norm_means(folder, means):
    """Give each norm of an HF checkpoint named (by ending) in `means` that mean, as an HF
    zero-centred weight (effective mean - 1), keeping its spread."""
    for shard in folder.glob("*.safetensors"):
        t = dict(mx.load(str(shard)))
        for name in list(t):
            ending = next((e for e in means if name.endswith(e)), None)
            if ending is not None:
                t[name] = t[name] - t[name].mean() + (means[ending] - 1.0)
        mx.save_safetensors(str(shard), t, metadata={"format": "pt"})


def test_a_trained_heads_norm_far_from_the_final_norm_but_like_the_models_own_loads(fixture_model, tmp_path):
    """The effective means of a trained demo's norms: its head's post-attention norm (0.87)
    sits 0.6 below the final norm (1.48) but among the model's own post-attention norms
    (0.75-1.09); the head loads, shifted once."""
    target = tmp_path / "trained"
    shutil.copytree(fixture_model("qwen3_5")["hf"], target)
    _set_norm_means(target, {"model.language_model.norm.weight": 1.48, "mtp.norm.weight": 1.38,
                             "mtp.layers.0.post_attention_layernorm.weight": 0.87,
                             "layers.0.post_attention_layernorm.weight": 0.75,
                             "layers.1.post_attention_layernorm.weight": 1.09})
    head = load(str(target))[0].head
    got = float(head.layers[0].post_attention_layernorm.weight.astype(mx.float32).mean())
    assert got == pytest.approx(0.87, abs=1e-3)


def test_a_head_shifted_all_but_its_pre_fc_norms_is_refused_by_name(fixture_model, tmp_path):
    """Mixed conventions give 0% acceptance: a head stored shifted except its two pre-fc
    norms reads as shifted, and those two then sit ~1 below every norm of the model."""
    target = tmp_path / "mixed"
    shutil.copytree(fixture_model("qwen3_5")["hf"], target)
    for shard in target.glob("*.safetensors"):
        t = dict(mx.load(str(shard)))
        for k in [k for k in t if k.startswith("mtp.") and hf_head.is_zero_centred_norm(k[4:])]:
            t[k] = t[k] + (0.0 if "pre_fc" in k else 1.0)
        mx.save_safetensors(str(shard), t, metadata={"format": "pt"})
    with pytest.raises(MTPLoadError, match=r"pre_fc_norm_\w+\.weight looks never shifted"):
        load(str(target))


def test_unreadable_foreign_heads_are_refused_by_name(tmp_path):
    folder = _demo_without_head(tmp_path)
    (folder / "mtp.safetensors").write_bytes(b"\xff" * 20)  # no safetensors header
    with pytest.raises(MTPLoadError, match="cannot be read"):
        load(str(folder))
    demo, _ = load(None)
    _quantize(demo.head, lambda path: 4)
    flat = {f"mtp.{k}": v for k, v in tree_flatten(demo.head.parameters()) if not k.endswith(".biases")}
    mx.save_safetensors(str(folder / "mtp.safetensors"), flat)  # scales without biases: not affine
    with pytest.raises(MTPLoadError, match="other than MLX's affine"):
        load(str(folder))
    model, _ = load(str(folder), mtp_fallback=True)
    assert not model.active and "affine" in model.disabled_reason


def test_a_rank_fetching_its_shards_from_the_hub_gets_the_sidecar_too(tmp_path, monkeypatch):
    """A distributed rank fetches only its own weight files, and the head's sidecar with them
    (every rank holds the head)."""
    from mlxmtp.models import model_folder

    source = _demo_without_head(tmp_path)
    shutil.copy(demo_model_path() / mtp_folder.FOLDER / mtp_folder.WEIGHTS, source / "mtp.safetensors")
    hub_from_folder(monkeypatch, source, tmp_path / "cache", "org/demo-mtp")
    folder = model_folder.resolve_model_path("org/demo-mtp", weight_files=[])
    assert (folder / "mtp.safetensors").is_file() and not (folder / "model.safetensors").exists()


@pytest.mark.parametrize("declared", [None, "heads/draft.safetensors", "../outside.safetensors"])
def test_a_sidecar_the_config_names_or_optiqs(tmp_path, declared):
    """The file `mlx_lm_extra_tensors.mtp_file` names (inside the folder only), else
    `optiq/mtp.safetensors`."""
    demo, _ = load(None)
    folder = _demo_without_head(tmp_path)
    name = declared or "optiq/mtp.safetensors"
    if declared:
        config = json.loads((folder / "config.json").read_text())
        config["mlx_lm_extra_tensors"] = {"mtp_file": declared}
        (folder / "config.json").write_text(json.dumps(config))
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    weights = mx.load(str(demo_model_path() / mtp_folder.FOLDER / mtp_folder.WEIGHTS))
    mx.save_safetensors(str(folder / name), {f"mtp.{k}": v for k, v in weights.items()})
    if declared and declared.startswith(".."):
        with pytest.raises(MTPLoadError, match="has no MTP head"):
            load(str(folder))
    else:
        _assert_same_params(load(str(folder))[0].head, demo.head)
