"""A request whose own code fails (a logits processor, its detokenizer) fails alone: the
other rows keep their caches and their output equals mlx-lm's, at every depth, whether
the failure comes at the first token, while drafting, at the verify or at output."""

import pytest
from engine_helpers import loaded, oracle_hook, prompt_of, reference_greedy

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.request import Request
from mlxmtp.engine.sampling.params import SamplingParams


def failing_after(n_calls: int):
    """A logits processor that passes logits through n_calls times, then raises."""
    calls = {"n": 0}

    def proc(ctx, logits):
        calls["n"] += 1
        if calls["n"] > n_calls:
            raise RuntimeError("poisoned processor")
        return logits

    return proc


class BrokenDetokenizer:
    """Raises on the n-th token it is given (a request's output stage failing)."""

    def __init__(self, inner, n: int):
        self.inner, self.n = inner, n

    def add_token(self, t):
        self.n -= 1
        if self.n <= 0:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned detokenizer")
        self.inner.add_token(t)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run(eng, requests, submit_at):
    outs, reasons, errors, step = {}, {}, {}, 0
    pending = sorted(zip(submit_at, requests), key=lambda x: x[0])
    while pending or eng.has_work:
        while pending and pending[0][0] <= step:
            eng.submit(pending.pop(0)[1])
        for ev in eng.step():
            outs.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finish_reason:
                reasons[ev.request_id], errors[ev.request_id] = ev.finish_reason, ev.error
        step += 1
        assert step < 2000
    return outs, reasons, errors


@pytest.mark.parametrize("depth", [0, 1, 3, None])
@pytest.mark.parametrize("fail_after", [0, 1, 7])
def test_a_failing_processor_fails_only_its_request(fixture_model, depth, fail_after):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    good = [Request(prompt=prompt_of(n, seed=50 + n), max_tokens=24) for n in (3, 20, 45)]
    expected = {r.id: reference_greedy(ref, r.prompt, r.max_tokens) for r in good}
    bad = Request(prompt=prompt_of(12, seed=9), max_tokens=24,
                  params=SamplingParams(logits_processors=[failing_after(fail_after)]))
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=depth, prefill_step=16))
    if depth:
        eng.draft_hook = oracle_hook(expected, p_correct=0.6, seed=depth)
    outs, reasons, errors = run(eng, good + [bad], [0, 0, 2, 1])
    assert reasons[bad.id] == "error" and "poisoned processor" in errors[bad.id]
    for r in good:
        assert reasons[r.id] == "length" and outs[r.id] == expected[r.id], r.id
    assert not eng.rows and not eng.waiting and eng.cache is None


@pytest.mark.parametrize("depth,pipelined", [(0, False), (2, False), (2, True)])
def test_a_failing_detokenizer_fails_only_its_request(fixture_model, depth, pipelined):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    good = [Request(prompt=prompt_of(n, seed=70 + n), max_tokens=20) for n in (4, 30)]
    expected = {r.id: reference_greedy(ref, r.prompt, r.max_tokens) for r in good}
    bad = Request(prompt=prompt_of(10, seed=3), max_tokens=20)
    eng = BatchGenerator(model, tok, EngineConfig(num_draft=depth, pipeline_drafts=pipelined))
    new_row = eng._new_row
    eng._new_row = lambda req: _with_broken_detok(new_row(req), 6) if req.id == bad.id else new_row(req)
    outs, reasons, errors = run(eng, good + [bad], [0, 0, 0])
    assert reasons[bad.id] == "error" and "poisoned detokenizer" in errors[bad.id]
    for r in good:
        assert outs[r.id] == expected[r.id], r.id


def _with_broken_detok(row, n):
    row.detok = BrokenDetokenizer(row.detok, n)
    return row


def test_requests_the_engine_cannot_run_are_refused_at_submit(fixture_model):
    model, tok, _ = loaded(str(fixture_model("qwen3_5")["hf"]))
    eng = BatchGenerator(model, tok)
    bad = [Request(prompt=[1, 2], num_draft=eng.policy.max_depth + 1),
           Request(prompt=[1, 2], params=SamplingParams(logit_bias={eng.vocab_size: 5.0})),
           Request(prompt=[1, 2], params=SamplingParams(logit_bias={-1: 5.0})),
           Request(prompt=[1, 2], params=SamplingParams(seed=-1)),
           Request(prompt=[1, 2], params=SamplingParams(seed=2**64)),
           Request(prompt=[1, 2], params=SamplingParams(temperature=float("nan"))),
           Request(prompt=[1, 2], params=SamplingParams(temperature=float("inf"))),
           Request(prompt=[1, 2], params=SamplingParams(repetition_penalty=float("nan"))),
           Request(prompt=[1, 2], logprobs=21),
           Request(prompt=[-1, 2])]
    for req in bad:
        with pytest.raises(ValueError):
            eng.submit(req)
    assert not eng.has_work


def test_short_prompts_are_prefilled_before_a_long_one(fixture_model):
    model, tok, ref = loaded(str(fixture_model("qwen3_5")["hf"]))
    long = Request(prompt=prompt_of(400, seed=1), max_tokens=4)
    short = Request(prompt=prompt_of(10, seed=2), max_tokens=4)
    eng = BatchGenerator(model, tok, EngineConfig(prefill_step=64))
    eng.submit(long)
    eng.step()  # the long prompt's first chunk
    eng.submit(short)
    first = eng.step()  # the short one is prefilled whole before the long one's next chunk
    assert any(ev.request_id == short.id and ev.token_ids for ev in first)
    outs, _, _ = run(eng, [], [])
    want = {r.id: reference_greedy(ref, r.prompt, r.max_tokens) for r in (long, short)}
    got = {short.id: [t for ev in first if ev.request_id == short.id for t in ev.token_ids] + outs.get(short.id, []),
           long.id: outs[long.id]}
    assert got == want
