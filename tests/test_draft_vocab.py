"""A trimmed draft vocabulary: the token list (EOS kept, deterministic, ids checked), the
trimmed lm_head (the model's own logits on the list, -inf elsewhere, q = 0 outside it),
greedy output unchanged and the sampled output distribution unchanged (chi-square)."""

import json
from unittest import mock

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from engine_helpers import prompt_of, reference_greedy
from test_sampling_exact import CHI2_999, chi2_quantile, chi2_two_sample

from mlxmtp.checkpoint import token_list
from mlxmtp.commands.draft_vocab import _tokenizer_and_config
from mlxmtp.commands.main import main as cli
from mlxmtp.convert.add_mtp_weights import add_mtp_weights
from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.generate import generate
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.engine.sampling.rejection import accept_sampled
from mlxmtp.engine.sampling.row import RowSampler
from mlxmtp.models import draft_vocab as dv
from mlxmtp.models.errors import MTPLoadError
from mlxmtp.models.load import load
from mlxmtp.testing.fixtures import write_hf_checkpoint

CORPUS = "the cat sat on the mat, and the dog is in the fog.\n" * 40 + "def f(x):\n    return x\n" * 10
SIZE = 48  # of the fixtures' 320 tokens


@pytest.fixture(autouse=True)
def small_vocab_trims(monkeypatch):
    """The fixtures' vocabularies are tiny: let them be trimmed like a 248K one."""
    monkeypatch.setattr(dv, "MIN_TRIM_VOCAB", 0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(CORPUS)
    return path


def make_list(model_dir, corpus, out, size=SIZE):
    res = CliRunner().invoke(cli, ["draft-vocab", "--model", str(model_dir), "--corpus", str(corpus),
                                   "--size", str(size)] + (["--out", str(out)] if out else []))
    assert res.exit_code == 0, res.output
    return json.loads((out or model_dir / "mtp" / token_list.FILE).read_text())


def test_list_keeps_eos_and_is_deterministic(fixture_model, corpus, tmp_path):
    hf = fixture_model("qwen3_5")["hf"]
    a = make_list(hf, corpus, tmp_path / "a.json")
    make_list(hf, corpus, tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert not list(tmp_path.glob(".draft_vocab-*"))  # no temporary file left behind
    _, tok, _ = _tokenizer_and_config(str(hf))
    ids = a["token_ids"]
    assert len(ids) == a["size"] == SIZE and len(set(ids)) == SIZE
    specials = ids[: a["num_special"]]
    assert tok.eos_token_ids and set(tok.eos_token_ids) <= set(specials)
    assert set(tok.all_special_ids) <= set(specials)
    counts = token_list.count_tokens(tok, [corpus])
    ranked = [counts[t] for t in ids[a["num_special"]:]]
    assert ranked == sorted(ranked, reverse=True) and ranked[0] == max(counts.values())  # most frequent first


def test_bad_lists_are_refused(fixture_model, corpus, tmp_path):
    hf = fixture_model("qwen3_5")["hf"]
    good = make_list(hf, corpus, tmp_path / "good.json")
    for name, change in [("range", {"token_ids": good["token_ids"][:-1] + [320]}),
                         ("dup", {"token_ids": good["token_ids"][:-1] + good["token_ids"][:1]}),
                         ("model", {"vocab_size": 1000})]:
        (tmp_path / f"{name}.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(MTPLoadError):
            load(str(hf), draft_vocab=SIZE, draft_vocab_file=tmp_path / f"{name}.json")
    with pytest.raises(MTPLoadError, match="fewer than"):
        load(str(hf), draft_vocab=SIZE + 1, draft_vocab_file=tmp_path / "good.json")
    with pytest.raises(MTPLoadError, match="mlxmtp draft-vocab"):
        load(str(hf), draft_vocab=SIZE)  # no mtp/ folder and no file given
    model, _ = load(str(hf))
    with pytest.raises(token_list.DraftVocabError, match="outside"):
        dv.DraftVocab(model.parts, token_ids=[0, 1, 320])


def test_small_vocabulary_is_not_trimmed(fixture_model, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(dv, "MIN_TRIM_VOCAB", 65536)
    hf = fixture_model("qwen3_5")["hf"]
    make_list(hf, corpus, tmp_path / "l.json")
    model, _ = load(str(hf), draft_vocab=SIZE, draft_vocab_file=tmp_path / "l.json")
    assert not model.vocab.trimmed


@pytest.fixture(scope="module")
def quantized_with_list(fixture_model, corpus):
    """A 4-bit mlx-lm conversion repaired with an mtp/ folder, its list written there."""
    paths = fixture_model("qwen3_5_tied")
    add_mtp_weights(paths["mlx_4bit"], str(paths["hf"]), echo=lambda s: None)
    return paths["mlx_4bit"], make_list(paths["mlx_4bit"], corpus, None)["token_ids"]


@pytest.mark.parametrize("variant", ["float", "quantized"])
def test_trimmed_lm_head_is_the_models_own_on_the_list(fixture_model, corpus, tmp_path, variant,
                                                       quantized_with_list):
    if variant == "float":
        path, ids = fixture_model("qwen3_5")["hf"], make_list(fixture_model("qwen3_5")["hf"], corpus,
                                                              tmp_path / "l.json")["token_ids"]
        model, _ = load(str(path), draft_vocab=SIZE, draft_vocab_file=tmp_path / "l.json")
    else:
        path, ids = quantized_with_list
        model, _ = load(str(path), draft_vocab=SIZE)  # the list in mtp/ by default
    vocab = model.vocab
    assert vocab.trimmed and (vocab._quant is not None) == (variant == "quantized")
    h = mx.random.normal((2, 1, model.parts.args.hidden_size), key=mx.random.key(0))
    got, full = vocab.lm_head(h), model.parts.lm_head(h)
    inside = np.zeros(got.shape[-1], bool)
    inside[ids] = True
    assert mx.allclose(got[..., mx.array(ids)], full[..., mx.array(ids)], atol=1e-5).item()
    assert np.isneginf(np.array(got)[..., ~inside]).all()


def test_q_is_a_distribution_over_the_list(fixture_model, corpus, tmp_path):
    """Penalties, filters and temperature keep q finite on the list, 0 outside, no NaN."""
    hf = fixture_model("qwen3_5")["hf"]
    ids = make_list(hf, corpus, tmp_path / "l.json")["token_ids"]
    model, _ = load(str(hf), draft_vocab=SIZE, draft_vocab_file=tmp_path / "l.json")
    h = mx.random.normal((1, 1, model.parts.args.hidden_size), key=mx.random.key(1))
    logits = model.vocab.lm_head(h)[:, 0]
    ctx = [mx.array(ids[:5] + [7, 9], dtype=mx.int32)]
    for params in [dict(temperature=0.7), dict(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05),
                   dict(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
                        logit_bias={ids[0]: 2.0, 7: 5.0})]:
        s = RowSampler(SamplingParams(**params, seed=0))
        q = np.array(mx.exp(s.logprobs(s.process(logits, ctx))))[0]
        assert not np.isnan(q).any() and abs(q.sum() - 1) < 1e-5, params
        outside = np.ones(q.shape, bool)
        outside[ids] = False
        assert (q[outside] == 0).all() and (q[~outside] > 0).any(), params


def _drafts_recorder(seen):
    def hook(rows, drafts, unread=None):
        seen.update(np.array(drafts).ravel().tolist())
        return drafts

    return hook


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, None])
def test_greedy_output_is_unchanged(fixture_model, corpus, tmp_path, k, quantized_with_list):
    hf = fixture_model("qwen3_5")["hf"]
    ids = make_list(hf, corpus, tmp_path / "l.json")["token_ids"]
    ref, _ = load(str(hf), mtp=False)
    prompt = prompt_of(23, seed=3)
    want = reference_greedy(ref, prompt, 40)
    qpath, qids = quantized_with_list
    for path, kw, allowed in [(hf, dict(draft_vocab_file=tmp_path / "l.json"), ids), (qpath, {}, qids)]:
        model, tok = load(str(path), draft_vocab=SIZE, **kw)
        full, _ = load(str(path))
        eng = BatchGenerator(model, tok, EngineConfig(num_draft=k))
        if k is None:  # the random fixture head barely pays: tell the policy drafting is free
            eng.policy.seed_costs(1, {d: 1.0 for d in range(eng.policy.max_depth + 1)})
        seen = set()
        eng.draft_hook = _drafts_recorder(seen)
        got = generate(model, tok, prompt, max_tokens=40, engine=eng).token_ids
        assert got == generate(full, tok, prompt, max_tokens=40, config=EngineConfig(num_draft=k)).token_ids
        if path == hf:
            assert got == want
        assert seen and seen <= set(allowed)  # the head only drafted listed tokens


@pytest.mark.slow
def test_rejection_sampler_with_q_zero_outside_the_list():
    """min(1, p/q) at the drafted token and the residual max(p - q, 0) with q = 0 (-inf log)
    outside the list: the first emitted token still follows p."""
    V, listed, N = 8, [0, 2, 3, 6], 3000
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(V) * 0.7, size=2)
    q = np.zeros((1, V))
    q[0, listed] = rng.dirichlet(np.ones(len(listed)))
    p_lp = mx.log(mx.array(p, dtype=mx.float32))
    with np.errstate(divide="ignore"):
        q_lp = mx.array(np.log(q), dtype=mx.float32)
    key, firsts = mx.random.key(2), []
    for _ in range(N):
        key, kd, ka = mx.random.split(key, 3)
        drafts = mx.random.categorical(q_lp, key=kd).astype(mx.int32)
        _, toks = accept_sampled(p_lp, q_lp, drafts, ka)
        firsts.append(toks[0])
    counts = np.bincount(np.array(mx.stack(firsts)), minlength=V)
    assert counts.sum() == N  # no NaN draw
    stat = (((counts - p[0] * N) ** 2) / (p[0] * N)).sum()
    assert stat < CHI2_999[V - 1], stat


def _samples(model, tok, *, enable_mtp, n, seed0, seen=None):
    # The prefix cache holds the shared prompt's state after the first request: the others
    # start from a copy of it (the same numbers) instead of prefilling it again.
    eng = BatchGenerator(model, tok, EngineConfig(enable_mtp=enable_mtp, num_draft=1, max_batch=64,
                                                  prefix_cache_bytes=64 << 20))
    if seen is not None:
        eng.draft_hook = _drafts_recorder(seen)
    for seed in range(seed0, seed0 + n):
        eng.submit(Request(prompt=[5, 17, 42, 9, 33, 2], max_tokens=3,
                           params=SamplingParams(temperature=0.5, seed=seed)))
    outs, kept = {}, [0, 0]
    while eng.has_work:
        for ev in eng.step():
            outs.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.stats is not None:
                kept = [kept[0] + ev.stats.accepted, kept[1] + ev.stats.drafted]
    return list(outs.values()), kept


@pytest.mark.slow
def test_sampling_with_a_trimmed_draft_matches_plain_sampling(tmp_path):
    """The chi-square pattern of test_sampling_exact, one draft position, q trimmed to 24 of 64."""
    path = write_hf_checkpoint(tmp_path / "m", "qwen3_5", vocab_size=64)
    ids = sorted(np.random.default_rng(0).choice(64, 24, replace=False).tolist())
    meta = {"format": token_list.FORMAT, "format_version": 1, "vocab_size": 64, "num_special": 0}
    token_list.write_token_list(tmp_path / "l.json", ids, meta)
    model, tok = load(str(path), draft_vocab=24, draft_vocab_file=tmp_path / "l.json")
    n, seen = 1200, set()
    plain, _ = _samples(model, tok, enable_mtp=False, n=n, seed0=0)
    mtp, (accepted, drafted) = _samples(model, tok, enable_mtp=True, n=n, seed0=n, seen=seen)
    assert seen and seen <= set(ids)
    # Both min(1, p/q) and the residual ran (the random head's drafts are mostly rejected:
    # ~2% kept; a residual dropping p outside the list then fails by a chi-square of ~2000).
    assert 0 < accepted < drafted
    for pos in (1, 2):
        stat, dof = chi2_two_sample([o[pos] for o in plain], [o[pos] for o in mtp])
        assert stat < chi2_quantile(dof), (pos, stat, dof)


@pytest.mark.slow
def test_generate_and_serve_options(fixture_model, corpus, tmp_path):
    hf = str(fixture_model("qwen3_5")["hf"])
    make_list(hf, corpus, tmp_path / "l.json")
    base = ["generate", "--model", hf, "--prompt", "def f(x):", "--no-chat-template", "-m", "24", "--json"]
    runs = [CliRunner().invoke(cli, base + extra) for extra in
            ([], ["--draft-vocab", str(SIZE), "--draft-vocab-file", str(tmp_path / "l.json")])]
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    ids = [json.loads(r.output.strip().splitlines()[-1])["token_ids"] for r in runs]
    assert ids[0] == ids[1]
    missing = CliRunner().invoke(cli, base + ["--draft-vocab", str(SIZE)])
    assert missing.exit_code != 0 and "mlxmtp draft-vocab" in missing.output
    with mock.patch("mlxmtp.server.shutdown.run_server"), mock.patch("mlxmtp.server.app.create_app") as app:
        res = CliRunner().invoke(cli, ["serve", "--model", hf, "--draft-vocab", str(SIZE),
                                       "--draft-vocab-file", str(tmp_path / "l.json")])
    assert res.exit_code == 0, res.output
    assert app.call_args.args[0].vocab.trimmed  # the model served drafts from the list
