"""Speculative sampling keeps the target distribution exactly (chi-square tests), and a
deliberately biased acceptance rule (keep a draft iff it is the target's argmax) is caught."""

import io
import re

import mlx.core as mx
import numpy as np
import pytest

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.engine.sampling.rejection import accept_sampled
from mlxmtp.engine.sampling.row import RowSampler
from mlxmtp.models.load import load
from mlxmtp.testing.fixtures import write_hf_checkpoint

# 99.9% quantiles of chi-square, to keep false alarms rare with fixed seeds anyway.
CHI2_999 = {7: 24.32, 15: 37.70, 31: 61.10, 63: 103.4}


def chi2_two_sample(a, b):
    """Two-sample chi-square statistic over the categories seen; returns (stat, dof)."""
    cats = sorted(set(a) | set(b))
    ca = np.array([a.count(c) for c in cats], float)
    cb = np.array([b.count(c) for c in cats], float)
    keep = (ca + cb) >= 10  # pool rare categories
    ca = np.append(ca[keep], ca[~keep].sum())
    cb = np.append(cb[keep], cb[~keep].sum())
    if ca[-1] + cb[-1] == 0:
        ca, cb = ca[:-1], cb[:-1]
    na, nb = ca.sum(), cb.sum()
    tot = ca + cb
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    stat = (((ca - ea) ** 2) / ea).sum() + (((cb - eb) ** 2) / eb).sum()
    return stat, len(tot) - 1


def chi2_quantile(dof):
    # Wilson-Hilferty approximation of the 99.9% quantile.
    z = 3.09
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("rule,should_match", [("exact", True), ("argmax", False)])
def test_rejection_sampler_first_token_follows_target(k, rule, should_match):
    V = 8
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(V) * 0.7, size=k + 1)
    q = rng.dirichlet(np.ones(V) * 0.7, size=k)
    p_lp, q_lp = mx.log(mx.array(p, dtype=mx.float32)), mx.log(mx.array(q, dtype=mx.float32))
    key = mx.random.key(1)
    firsts = []
    N = 3000
    for _ in range(N):
        key, kd, ka = mx.random.split(key, 3)
        drafts = mx.random.categorical(q_lp, key=kd).astype(mx.int32)
        _, toks = accept_sampled(p_lp, q_lp, drafts, ka, rule=rule)
        firsts.append(toks[0])
    counts = np.bincount(np.array(mx.stack(firsts)), minlength=V)
    expected = p[0] * N
    stat = (((counts - expected) ** 2) / expected).sum()
    assert (stat < CHI2_999[V - 1]) == should_match, stat


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_temperature_only_sampler_is_mlx_lms_distribution(dtype):
    # The compiled temperature-only path against the filtered path's formula (mlx-lm's
    # order: log-softmax, then temperature, then log-softmax again), and its draws against
    # the exact distribution.
    V, temp, N = 8, 0.6, 4000
    rng = np.random.default_rng(1)
    logits = mx.array(rng.normal(size=(2, V)) * 2, dtype=dtype)
    fast = RowSampler(SamplingParams(temperature=temp, seed=3))
    slow = RowSampler(SamplingParams(temperature=temp, seed=3, top_p=1.0 - 1e-9))  # no token cut
    assert not fast.filtered and slow.filtered
    lp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
    want = lp / temp - mx.logsumexp(lp / temp, axis=-1, keepdims=True)
    for s in (fast, slow):
        assert mx.allclose(s.logprobs(logits).astype(mx.float32), want, atol=2e-2 if dtype == mx.float16 else 1e-5)
    assert mx.allclose(fast.pick(logits)[1].astype(mx.float32), want, atol=2e-2 if dtype == mx.float16 else 1e-5)
    # Plain decoding's draw, and a draft's (which also returns its q), batched over rows.
    for draw in (fast.draw, lambda lg: fast.pick(lg)[0]):
        draws = np.array(mx.stack([draw(logits) for _ in range(N)]))  # [N, 2]
        for row in range(2):
            counts = np.bincount(draws[:, row], minlength=V)
            expected = np.exp(np.array(want[row])) * N
            stat = (((counts - expected) ** 2) / expected).sum()
            assert stat < CHI2_999[V - 1], (row, stat)


class OracleDraftEngine(BatchGenerator):
    """Drafts from q = 0.8 p + 0.2 uniform, p being the target's own processed distribution.

    The fixture's random head is so far from the model that a wrong acceptance rule barely
    shows; a draft distribution close to the target's is what real heads give and what
    makes a biased rule visible. The engine's acceptance path is unchanged."""

    def _picker(self, sampling):
        def pick(step, logits, so_far):
            toks, qs = [], []
            for b, (sampler, tokens) in enumerate(zip(sampling.samplers, sampling.contexts)):
                q = self._draft_logprobs(sampler, tokens + so_far[b].tolist())
                toks.append(mx.random.categorical(q, key=sampler.next_key())[0])
                qs.append(q[0])
            return mx.stack(toks), mx.stack(qs)

        return pick

    def _draft_logprobs(self, sampler, context):
        """log q for `context`, each context's computed once: p depends on the context and
        the sampling parameters alone, which every row of one engine shares (only the seeds
        differ). The tests' rows share one short prompt, so a few hundred contexts serve
        thousands of drafts."""
        memo = self.__dict__.setdefault("_q_memo", {})
        if tuple(context) not in memo:
            ctx = mx.array(context, dtype=mx.int32)
            target = self.model(ctx[None])[0, -1:]
            p = mx.exp(sampler.logprobs(sampler.process(target, [ctx])))
            memo[tuple(context)] = mx.log(0.8 * p + 0.2 / p.shape[-1])
        return memo[tuple(context)]


def _sample_tokens(model, tok, *, enable_mtp, rule, n, params, seed0, **engine_options):
    eng = OracleDraftEngine(model, tok, EngineConfig(enable_mtp=enable_mtp, num_draft=2, max_batch=64,
                                                     prefix_cache_bytes=64 << 20, acceptance_rule=rule,
                                                     **engine_options))
    prompt = [5, 17, 42, 9, 33, 2]
    # Distinct seeds per arm: paired seeds would share first tokens and deflate the statistic.
    for seed in range(seed0, seed0 + n):
        p = SamplingParams(**params, seed=seed)
        eng.submit(Request(prompt=prompt, max_tokens=3, params=p))
    outs = {}
    while eng.has_work:
        for ev in eng.step():
            outs.setdefault(ev.request_id, []).extend(ev.token_ids)
    return list(outs.values())


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("tiny_vocab") / "m", "qwen3_5", vocab_size=64)
    return load(str(path))


N = 1200
PARAMS = dict(temperature=0.5)


@pytest.fixture(scope="module")
def plain_samples(tiny_vocab_model):
    model, tok = tiny_vocab_model
    return _sample_tokens(model, tok, enable_mtp=False, rule="exact", n=N, params=PARAMS, seed0=0)


def _chi2_by_position(a, b):
    return [chi2_two_sample([o[pos] for o in a], [o[pos] for o in b]) for pos in (1, 2)]


# Drafting cycles synchronous, pipelined, or with compiled head steps and accept step
# (each on its own seeds).
MODES = {"synchronous": (1, {}), "pipelined": (3, {"pipeline_drafts": True}),
         "compiled": (4, {"compile_steps": True, "shape_stable": True})}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_engine_sampling_matches_plain_sampling(tiny_vocab_model, plain_samples, mode):
    model, tok = tiny_vocab_model
    seeds, options = MODES[mode]
    mtp = _sample_tokens(model, tok, enable_mtp=True, rule="exact", n=N, params=PARAMS, seed0=seeds * N, **options)
    for stat, dof in _chi2_by_position(plain_samples, mtp):
        assert stat < chi2_quantile(dof), (stat, dof)


@pytest.mark.slow
def test_engine_catches_biased_acceptance_rule(tiny_vocab_model, plain_samples):
    model, tok = tiny_vocab_model
    biased = _sample_tokens(model, tok, enable_mtp=True, rule="argmax", n=N, params=PARAMS, seed0=2 * N)
    stats = _chi2_by_position(plain_samples, biased)
    assert any(stat > chi2_quantile(dof) for stat, dof in stats), stats


@pytest.mark.slow
@pytest.mark.parametrize("penalty", [1.3, None], ids=["row by row", "vectorised"])
def test_engine_sampling_with_filters_and_penalty(tiny_vocab_model, penalty):
    """top-k / top-p / repetition penalty are applied to p and q alike: with a processor
    each row is decided on its own, without one the filtered rows in groups
    (BatchSampling.filter_groups)."""
    model, tok = tiny_vocab_model
    params = dict(temperature=1.0, top_k=20, top_p=0.9, repetition_penalty=penalty)
    n = 600
    plain = _sample_tokens(model, tok, enable_mtp=False, rule="exact", n=n, params=params, seed0=0)
    mtp = _sample_tokens(model, tok, enable_mtp=True, rule="exact", n=n, params=params, seed0=n)
    for stat, dof in _chi2_by_position(plain, mtp):
        assert stat < chi2_quantile(dof), (stat, dof)


def test_vectorised_accept_equals_each_row_alone():
    """accept_sampled_rows decides S rows at once exactly as accept_sampled does each row
    with its own key (a row's random numbers come from its key alone); its compiled graph
    decides them alike."""
    from mlxmtp.engine.sampling.rejection import (
        accept_sampled_rows,
        compiled_accept_sampled_rows,
        row_noise,
    )

    S, k, V = 6, 3, 40
    p = mx.random.normal((S, k + 1, V), key=mx.random.key(1)) * 2
    p = p - mx.logsumexp(p, axis=-1, keepdims=True)
    q = p[:, :k] + 0.7 * mx.random.normal((S, k, V), key=mx.random.key(2))
    q = q - mx.logsumexp(q, axis=-1, keepdims=True)
    drafts = mx.random.categorical(q, key=mx.random.key(3))
    keys = [mx.random.key(10 + s) for s in range(S)]
    noise = [row_noise(key, k, V) for key in keys]
    u, g = mx.stack([n[0] for n in noise]), mx.stack([n[1] for n in noise])
    kept, tokens = accept_sampled_rows(p, q, drafts, u, g)
    kept_c, tokens_c = compiled_accept_sampled_rows["exact"](p, q, drafts, u, g)
    assert kept_c.tolist() == kept.tolist() and tokens_c.tolist() == tokens.tolist()
    for s in range(S):
        kept_s, tokens_s = accept_sampled(p[s], q[s], drafts[s], keys[s])
        assert kept[s].item() == kept_s.item() and tokens[s].tolist() == tokens_s.tolist()
    assert len(set(kept.tolist())) > 1  # rows kept different numbers of drafts


@pytest.mark.parametrize("k", [0, 3])
def test_vectorised_rows_decide_as_row_by_row(k):
    """A batch of greedy, temperature-only and filtered rows (two sharing their settings)
    drafts and decides exactly as the row-by-row path does (the path a batch takes when a
    row has a logits processor; an identity processor forces it here): the same drafts,
    the same q of every sampled row, the same kept counts and tokens, from float16 logits."""
    from mlxmtp.engine.sampling.accept import VerifyMetadata, accept, picker

    settings = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=0.8, top_p=0.7, top_k=40),
                dict(temperature=0.8, top_p=0.7, top_k=40), dict(temperature=1.2, min_p=0.05),
                dict(temperature=0.5, top_k=5)]
    B, V = len(settings), 300
    logits = (3 * mx.random.normal((B, k + 1, V), key=mx.random.key(7))).astype(mx.float16)

    def run(row_by_row):
        procs = [lambda ctx, lg: lg] if row_by_row else []
        samplers = [RowSampler(SamplingParams(**st, seed=b, logits_processors=list(procs)))
                    for b, st in enumerate(settings)]
        pick = picker(samplers, [[1, 2]] * B, list(range(B)))
        drafts, qs = mx.zeros((B, 0), mx.int32), []
        for j in range(k):
            tok, q = pick(j, logits[:, j], drafts)
            drafts = mx.concatenate([drafts, tok.astype(mx.int32)[:, None]], axis=1)
            qs.append(q)
        q = mx.stack(qs, axis=1) if qs else None
        kept, tokens, _, _ = accept(VerifyMetadata(drafts, q, samplers, [[1, 2]] * B, list(range(B)), None), logits)
        return drafts, q, kept, tokens

    mine, theirs = run(False), run(True)
    sampled = mx.array([b for b, st in enumerate(settings) if st["temperature"] > 0])
    assert mine[0].tolist() == theirs[0].tolist()
    if k:
        assert mx.array_equal(mine[1][sampled], theirs[1][sampled].astype(mx.float32))
    assert mine[2].tolist() == theirs[2].tolist() and mine[3].tolist() == theirs[3].tolist()


def _run_together(model, tok, requests, **engine_options):
    eng = BatchGenerator(model, tok, EngineConfig(max_batch=8, prefix_cache_bytes=0, **engine_options))
    ids = [eng.submit(r) for r in requests]
    out = {i: [] for i in ids}
    while eng.has_work:
        for ev in eng.step():
            out[ev.request_id] += ev.token_ids
    return [out[i] for i in ids]


@pytest.mark.parametrize("num_draft", [0, 3])
def test_a_seeded_sampled_row_draws_the_same_alone_or_in_any_batch(tiny_vocab_model, num_draft):
    """A seeded request's tokens depend on its own key alone: the same alone, in a batch of
    temperature-only and greedy rows (decided by the vectorised steps), and in a batch
    with a row that has a logits processor (decided row by row)."""
    model, tok = tiny_vocab_model
    opts = dict(enable_mtp=num_draft > 0, num_draft=num_draft or None)

    def mine():
        return Request(prompt=[5, 17, 42, 9, 33, 2], max_tokens=24, params=SamplingParams(temperature=0.9, seed=11))

    def others(penalty):
        return [Request(prompt=[3, 8, 1], max_tokens=24, params=SamplingParams(temperature=0.0)),
                Request(prompt=[7, 7, 2, 40], max_tokens=24,
                        params=SamplingParams(temperature=1.3, seed=2, repetition_penalty=penalty))]

    alone = _run_together(model, tok, [mine()], **opts)[0]
    plain = _run_together(model, tok, [others(None)[0], mine(), others(None)[1]], **opts)[1]
    mixed = _run_together(model, tok, [others(1.2)[1], mine()], **opts)[1]
    assert len(alone) == 24
    assert plain == alone and mixed == alone


@pytest.mark.parametrize("num_draft", [0, 3])
@pytest.mark.parametrize("which", ["float32 fixture", "float16 demo"])
def test_a_seeded_filtered_row_draws_the_same_alone_or_in_any_batch(tiny_vocab_model, num_draft, which):
    """The same for a row with top-p and top-k (decided with the other rows of its group of
    equal settings, BatchSampling.filter_groups): alone, in a batch of greedy, temperature-only
    and other filtered rows and a row of its own settings, and in a batch with a row
    that has a logits processor (decided row by row). On a float16 model too, whose
    filtered log-probabilities are float16."""
    if which == "float16 demo":
        from mlxmtp.models.demo import demo_model_path

        model, tok = load(str(demo_model_path()))
    else:
        model, tok = tiny_vocab_model
    opts = dict(enable_mtp=num_draft > 0, num_draft=num_draft or None)
    mine_params = dict(temperature=0.9, top_p=0.8, top_k=12)

    def mine(seed=11):
        return Request(prompt=[5, 17, 42, 9, 33, 2], max_tokens=24, params=SamplingParams(**mine_params, seed=seed))

    # The others ask for fewer tokens: a cycle drafts up to the room of the row with the
    # most left, and a different depth would draw from other keys than the row alone does.
    def other(seed, **params):
        return Request(prompt=[7, 7, 2, 40], max_tokens=8, params=SamplingParams(seed=seed, **params))

    alone = _run_together(model, tok, [mine()], **opts)[0]
    same_settings = Request(prompt=[9, 4, 4], max_tokens=8, params=SamplingParams(**mine_params, seed=12))
    batch = [other(1), mine(), other(2, temperature=1.1), other(3, temperature=0.7, min_p=0.1), same_settings,
             other(4, temperature=0.9, top_p=0.5)]
    together = _run_together(model, tok, batch, **opts)[1]
    mixed = _run_together(model, tok, [other(5, temperature=1.3, repetition_penalty=1.2), mine()], **opts)[1]
    assert len(alone) == 24
    assert together == alone and mixed == alone


def _graph_nodes(*arrays) -> int:
    out = io.StringIO()
    mx.export_to_dot(out, *arrays)
    return len(re.findall(r'label\s*=\s*"[A-Za-z]', out.getvalue()))


def _pick_and_accept_nodes(params, k=3, V=500):
    """Graph nodes of one draft pick and of one accept step (depth k) for rows of `params`."""
    from mlxmtp.engine.sampling.accept import VerifyMetadata, accept, picker

    B = len(params)
    samplers = [RowSampler(p) for p in params]
    logits = mx.random.normal((B, k + 1, V), key=mx.random.key(B))
    mx.eval(logits, *[s.key for s in samplers])
    tok, q = picker(samplers, [[0]] * B, [0] * B)(0, logits[:, 0], mx.zeros((B, 0), mx.int32))
    drafts = mx.zeros((B, k), mx.int32)
    qs = mx.broadcast_to(q[:, None], (B, k, V))
    kept, tokens, _, _ = accept(VerifyMetadata(drafts, qs, samplers, [[0]] * B, [0] * B, None), logits)
    return _graph_nodes(tok, q), _graph_nodes(kept, tokens)


def test_a_batch_of_sampled_rows_is_drafted_and_decided_by_one_set_of_ops():
    """Temperature-only rows draw their drafts and are accepted in vectorised steps: eight
    rows build about as many operations as one (row by row, each row added its own dozens,
    which a GPU pays in kernel launches every cycle)."""
    def nodes(B):
        return _pick_and_accept_nodes([SamplingParams(temperature=0.7, seed=b) for b in range(B)])

    (pick1, accept1), (pick8, accept8) = nodes(1), nodes(8)
    # What each further row adds is a few views of its key (row by row it added ~40 nodes
    # to each step).
    assert pick8 - pick1 <= 7 * 3 and accept8 - accept1 <= 7 * 8, (pick1, pick8, accept1, accept8)


def test_a_batch_of_filtered_rows_is_drafted_and_decided_by_one_set_of_ops():
    """Rows with top-p / top-k that share their settings are filtered by one call for all
    of them (BatchSampling.filter_groups): eight such rows build about as many operations as
    one, a second group of other settings about one set more (row by row, eight rows
    built eight times the operations of one)."""
    def nodes(B, groups=1):
        return _pick_and_accept_nodes([SamplingParams(temperature=0.7, top_p=0.9 - 0.1 * (b % groups), top_k=50,
                                                      seed=b) for b in range(B)])

    (pick1, accept1), (pick8, accept8), (pick8b, accept8b) = nodes(1), nodes(8), nodes(8, groups=2)
    assert pick8 - pick1 <= 7 * 3 and accept8 - accept1 <= 7 * 8, (pick1, pick8, accept1, accept8)
    # A second group adds one set more, and the gathers and writes of both groups' rows.
    assert pick8b - pick8 < 1.5 * pick1 and accept8b - accept8 < accept1, (pick1, pick8, pick8b, accept1, accept8b)



def test_a_row_s_context_array_follows_its_tokens():
    # Processors see the row's tokens as an array, kept and extended from cycle to cycle
    # (an agent's context converted anew each cycle would cost milliseconds).
    s = RowSampler(SamplingParams())
    tokens = list(range(50))
    first = s.context(tokens)
    assert s.context(tokens) is first  # nothing new: the same array
    tokens += [7, 8, 9]
    assert s.context(tokens).tolist() == tokens
    assert s.context(tokens[:10]).tolist() == tokens[:10]  # shorter (another row's list): made anew
