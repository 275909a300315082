"""The shipped demo model (mlxmtp/demo_model/, built by scripts/train_demo_model.py).

Acceptance here is a measurement on a deterministic shipped artifact (greedy decoding,
fixed prompts), not a timing, so a threshold on it is a fair test.
"""

from pathlib import Path

import pytest

from mlxmtp.engine.config import EngineConfig
from mlxmtp.models import demo


def test_demo_model_is_shipped():
    # No skip: the package ships the demo model, a missing one is a failure.
    assert (demo.PACKAGED / "config.json").exists()
    assert (demo.PACKAGED / "mtp" / "config.json").exists()

# From standard-library files the tokenizer and model never saw (held out by the
# training script's deterministic split, listed in demo_model/training.json).
HELD_OUT_FNMATCH = '''def translate(pat):
    """Translate a shell PATTERN to a regular expression.

    There is no way to quote meta-characters.
    """

    STAR = object()
    res = []
    add = res.append
    i, n = 0, len(pat)
    while i < n:
        c = pat[i]
        i = i+1
'''
HELD_OUT_CSV = '''class DictReader:
    def __init__(self, f, fieldnames=None, restkey=None, restval=None,
                 dialect="excel", *args, **kwds):
        self._fieldnames = fieldnames   # list of keys for the dict
        self.restkey = restkey          # key to catch long rows
        self.restval = restval          # default value for short rows
        self.reader = reader(f, dialect, *args, **kwds)
        self.dialect = dialect
        self.line_num = 0

    def __iter__(self):
        return self
'''


@pytest.fixture(scope="module")
def demo_model():
    import mlxmtp

    return mlxmtp.load()  # no path: the packaged demo model


def test_default_model_is_the_packaged_demo_with_an_active_head(demo_model):
    model, _ = demo_model
    assert demo.demo_model_path() == demo.PACKAGED
    assert model.active, model.disabled_reason
    assert model.parts.family == "qwen3_5"


def test_demo_model_size_limit():
    size = sum(f.stat().st_size for f in Path(demo.PACKAGED).rglob("*") if f.is_file())
    assert size <= 20 * 1024 * 1024, size


def test_held_out_prompts_are_held_out():
    import json

    held = json.loads((demo.PACKAGED / "training.json").read_text())["held_out_files"]
    assert "fnmatch.py" in held and "csv.py" in held


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [HELD_OUT_FNMATCH, HELD_OUT_CSV], ids=["fnmatch", "csv"])
def test_greedy_mtp_equals_greedy_without_mtp(demo_model, prompt):
    from mlxmtp.engine.generate import generate

    model, tok = demo_model
    ids = tok.encode(prompt)
    on = generate(model, tok, ids, max_tokens=64, config=EngineConfig(enable_mtp=True, num_draft=2))
    off = generate(model, tok, ids, max_tokens=64, config=EngineConfig(enable_mtp=False))
    assert on.token_ids == off.token_ids


@pytest.mark.slow
def test_depth1_greedy_acceptance_on_held_out_code(demo_model):
    """Mean depth-1 acceptance over every held-out prompt (not a hand-picked one) >= 60%."""
    from mlxmtp.engine.generate import generate
    from mlxmtp.models.demo_prompts import HELD_OUT_PROMPTS

    model, tok = demo_model
    accs = {}
    for name, prompt in HELD_OUT_PROMPTS.items():
        stats = generate(model, tok, tok.encode(prompt), max_tokens=100,
                         config=EngineConfig(num_draft=1)).stats.as_dict()
        assert stats["drafted"] > 0
        accs[name] = stats["acceptance"]
    assert sum(accs.values()) / len(accs) >= 0.6, accs


def test_drafter_uses_a_float32_vocabulary_copy_on_the_cpu(demo_model):
    # The head computes in float32 on the CPU; a float16 table would be cast on every draft
    # step. The copy must give the same logits as the model's own projection, up to rounding.
    import mlx.core as mx

    model, _ = demo_model
    vocab, parts = model.vocab, model.parts
    assert vocab.copied == (mx.default_device() == mx.cpu)
    h = mx.random.normal((1, 3, parts.args.hidden_size), key=mx.random.key(0))
    ids = mx.array([[1, 2, 3]])
    assert mx.allclose(vocab.lm_head(h), parts.lm_head(h.astype(mx.float16)).astype(mx.float32), atol=0.05, rtol=0.01)
    assert mx.array_equal(vocab.embed_tokens(ids), parts.embed_tokens(ids).astype(mx.float32))


def _strings(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def test_the_shipped_files_name_no_folder_of_the_machine_that_built_them():
    import json
    import os

    for f in sorted(demo.PACKAGED.rglob("*.json")):
        if f.name == "tokenizer.json":  # its strings are tokens ("/", "//", ...)
            continue
        strings = list(_strings(json.loads(f.read_text())))
        assert "_name_or_path" not in strings, f
        assert not [s for s in strings if os.path.isabs(s) or s.startswith("~")], f
    text = "".join(f.read_text() for f in demo.PACKAGED.rglob("*") if f.suffix in (".json", ".md", ".jinja"))
    assert "/work/" not in text and "/home/" not in text and "/Users/" not in text


def test_packaging_keeps_the_model_card_and_writes_no_build_folder(tmp_path):
    """scripts/train_demo_model.py's `package` step, on a tiny HF checkpoint standing in for
    the trained export: the hand-written card survives, the head names no build folder."""
    import importlib.util
    import json
    from argparse import Namespace

    from mlxmtp.testing.fixtures import write_hf_checkpoint

    spec = importlib.util.spec_from_file_location(
        "train_demo_model", Path(__file__).resolve().parent.parent / "scripts" / "train_demo_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    hf = write_hf_checkpoint(tmp_path / "export", "qwen3_5", num_shards=2)
    (hf / "training.json").write_text("{}")
    dest = tmp_path / "demo_model"
    dest.mkdir()
    (dest / "README.md").write_text("# the model card\n")
    script.cmd_package(Namespace(hf=str(hf), dest=str(dest)))
    assert (dest / "README.md").read_text() == "# the model card\n"
    assert json.loads((dest / "mtp" / "config.json").read_text())["source"] == script.HEAD_SOURCE
    for f in dest.rglob("*.json"):
        assert str(tmp_path) not in f.read_text(), f

