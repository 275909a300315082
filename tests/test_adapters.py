"""Fine-tuned adapters (`--adapter-path`, an `mlx_lm.lora` output folder): the model is the
adapted one, exactly as mlx-lm loads it, and MTP decoding keeps its output token for token
(the head was trained for the base model: it drafts, the adapted model decides)."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from click.testing import CliRunner
from engine_helpers import oracle_hook, prompt_of, reference_greedy
from mlx.utils import tree_flatten, tree_unflatten

from mlxmtp.commands.main import main
from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.generate import generate
from mlxmtp.engine.request import Request
from mlxmtp.models.errors import MTPLoadError
from mlxmtp.models.load import load

LORA = {"rank": 4, "scale": 10.0, "dropout": 0.0}


def write_adapters(model_dir: Path, out: Path, num_layers: int = 2, seed: int = 0) -> Path:
    """A LoRA adapter folder as `mlx_lm.lora` writes one, with random (non-zero) weights on
    mlx-lm's default projections of the last `num_layers` layers."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = mlx_lm.load(str(model_dir))
    model.freeze()
    linear_to_lora_layers(model, num_layers, LORA)
    mx.random.seed(seed)
    trained = [(k, 0.05 * mx.random.normal(v.shape)) for k, v in tree_flatten(model.trainable_parameters())]
    model.update(tree_unflatten(trained))
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    (out / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": LORA}))
    return out


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def adapted(request, fixture_model, tmp_path_factory):
    """(model folder, adapter folder, mlxmtp model + tokenizer, mlx-lm's adapted model)."""
    path = fixture_model(request.param)["hf"]
    adapters = write_adapters(path, tmp_path_factory.mktemp("adapters") / request.param)
    model, tok = load(str(path), adapter_path=adapters)
    ref, _ = mlx_lm.load(str(path), adapter_path=str(adapters))
    return path, adapters, model, tok, ref


@pytest.mark.slow
def test_adapted_greedy_output_is_mlx_lm_s_at_every_depth(adapted):
    path, _, model, tok, ref = adapted
    prompt = prompt_of(29, seed=3)
    want = reference_greedy(ref, prompt, 80)
    base, _ = mlx_lm.load(str(path))
    assert reference_greedy(base, prompt, 80) != want  # the adapters change the model's output
    for k in (0, 1, 3, None):
        assert generate(model, tok, prompt, max_tokens=80, config=EngineConfig(num_draft=k)).token_ids == want, k


def test_adapted_model_rolls_back_exactly_with_every_acceptance_length(adapted):
    _, _, model, tok, ref = adapted
    prompt = prompt_of(17, seed=5)
    want = reference_greedy(ref, prompt, 60)
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=3))
    req = Request(prompt=prompt, max_tokens=len(want))
    eng.submit(req)
    eng.draft_hook = oracle_hook({req.id: want}, p_correct=0.7, seed=1)
    got = []
    while eng.has_work:
        for ev in eng.step():
            got += ev.token_ids
    assert got == want


def test_generate_and_serve_take_the_adapters(adapted):
    path, adapters, _, tok, ref = adapted
    prompt = "def f(x):"
    res = CliRunner().invoke(main, ["generate", "--model", str(path), "--adapter-path", str(adapters), "-p", prompt,
                                    "--no-chat-template", "-m", "24", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["token_ids"] == reference_greedy(ref, tok.encode(prompt), 24)
    res = CliRunner().invoke(main, ["serve", "--adapter-path", str(path / "missing")])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_adapters_are_refused_across_ranks_before_the_weights_load(adapted):
    path, adapters, *_ = adapted
    with pytest.raises(MTPLoadError, match="mlx_lm.fuse"):
        load(str(path), adapter_path=adapters, pipeline=(None, [1], True))


def test_adapters_that_cannot_apply_are_a_clear_error(adapted, fixture_model, tmp_path):
    path, adapters, *_ = adapted
    other = "qwen3_next" if "qwen3_5" in str(path) else "qwen3_5"
    broken = tmp_path / "no_weights"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((adapters / "adapter_config.json").read_text())
    no_layers = tmp_path / "no_num_layers"
    shutil.copytree(adapters, no_layers)
    (no_layers / "adapter_config.json").write_text(json.dumps({"lora_parameters": LORA}))
    for folder, message in [(broken, "adapters.safetensors"), (tmp_path, "adapter_config.json"),
                            (no_layers, "num_layers"), (adapters, "incompatible tensors")]:
        model = path if folder is not adapters else fixture_model(other)["hf"]  # another model's shapes
        with pytest.raises(MTPLoadError, match="cannot apply the adapters"):
            load(str(model), adapter_path=folder)
        res = CliRunner().invoke(main, ["generate", "--model", str(model), "--adapter-path", str(folder), "-p", "x"])
        assert res.exit_code == 1 and "cannot apply the adapters" in res.output and message in res.output, res.output
        assert res.exc_info[0] is SystemExit  # a message, not a traceback
