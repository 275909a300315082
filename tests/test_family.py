"""The supported families (mlxlm/family.py): each names classes mlx-lm has, the patches
reach every layer of each, and a layer they missed is refused when the engine prepares
the model, before its first forward."""

import mlx.nn as nn
import pytest
from mlx_lm.models import gated_delta, qwen3_5

from mlxmtp.mlxlm import adapter, loading
from mlxmtp.mlxlm.family import (
    FAMILIES,
    UnpatchedLayerError,
    check_patched,
    patched_modules,
    text_parts,
)
from mlxmtp.mlxlm.pipeline import local_layers

KINDS = ("decoder_layer", "linear_attention", "attention", "mlp", "moe")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_names_classes_mlx_lm_has(name):
    spec = FAMILIES[name]
    for kind in KINDS:
        assert issubclass(spec.layer_class(kind), nn.Module), (name, kind)
    for kind in ("linear_attention", "attention"):
        assert spec.patched_module(kind) in patched_modules(kind)


def _prepared_layers(fixture_model, name):
    model, _ = loading.load(fixture_model(name)["hf"])
    parts = text_parts(model)
    adapter.prepare_model(parts.text_model)  # checks every layer itself
    return model, local_layers(parts.backbone)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "qwen3_6_moe"])
def test_the_patches_reach_every_layer_of_each_family(fixture_model, name):
    model, layers = _prepared_layers(fixture_model, name)
    assert text_parts(model).spec is FAMILIES[text_parts(model).family]
    assert any(layer.is_linear for layer in layers) and not all(layer.is_linear for layer in layers)
    check_patched(layers)


def test_a_layer_no_family_declares_is_refused(fixture_model):
    _, layers = _prepared_layers(fixture_model, "qwen3_5")
    with pytest.raises(UnpatchedLayerError, match=f"layer {len(layers)} is a Linear, which no supported family"):
        check_patched([*layers, nn.Linear(2, 2)])


def test_a_module_the_patch_missed_is_refused(fixture_model, monkeypatch):
    _, layers = _prepared_layers(fixture_model, "qwen3_5")
    monkeypatch.setattr(qwen3_5, "gated_delta_update", gated_delta.gated_delta_update)  # as mlx-lm ships it
    with pytest.raises(UnpatchedLayerError, match=r"layer 0 \(mlx_lm.models.qwen3_5.GatedDeltaNet\) is not patched"):
        check_patched(layers)


def test_layers_of_a_model_never_prepared_are_refused(fixture_model):
    model, _ = loading.load(fixture_model("qwen3_next")["hf"])  # its convs were never swapped
    with pytest.raises(UnpatchedLayerError, match="is not patched for qwen3_next"):
        check_patched(local_layers(text_parts(model).backbone))
