"""The suffix drafter (engine/suffix_index.py): exact proposals on small hand-made sequences,
and the same drafts as a brute-force reference (every occurrence of the matched string,
counted) on random ones. Pure numpy, no model."""

import gc
import random
import weakref
from collections import Counter

import pytest

from mlxmtp.engine.suffix_index import SharedOutputs, SuffixDrafter
from mlxmtp.engine.token_index import TokenIndex


def test_a_repeated_span_is_proposed_in_full():
    span = list(range(10, 40))
    d = SuffixDrafter([1, 2] + span + [3, 4] + span[:5], spec_factor=8.0)
    draft = d.propose(max_len=25)
    assert draft.tokens == span[5:] and draft.probs == [1.0] * 25 and draft.match_len == 5
    assert draft.score == 25.0


def test_the_length_follows_the_match_length_and_max_len():
    span = list(range(10, 40))
    d = SuffixDrafter([1, 2] + span + [3, 4] + span[:5])  # spec_factor 1: 5 matched, 5 drafted
    assert d.propose(max_len=32).tokens == span[5:10]
    assert d.propose(max_len=3).tokens == span[5:8]
    assert d.propose(max_len=0).tokens == []


def test_the_most_frequent_branch_wins():
    d = SuffixDrafter([7, 1, 2, 3, 8, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2])
    draft = d.propose(max_len=8)
    # "1 2" -> 3 twice, 4 once; "1 2 3" -> 8 once, 9 once: the tie goes to the later one.
    assert draft.tokens == [3, 9] and draft.match_len == 2
    assert draft.probs == pytest.approx([2 / 3, 1 / 3])


def test_the_length_stops_where_the_frequency_drops():
    shared = SharedOutputs()
    for out in [[1, 2, 3, 4, 5]] * 3 + [[1, 2, 3, 4, 6]] * 2:
        shared.add(out)
    d = SuffixDrafter([9, 1, 2], shared, spec_factor=4.0, min_prob=0.7)
    assert d.propose(max_len=8).tokens == [3, 4]  # 5 would have 3/5
    d = SuffixDrafter([9, 1, 2], shared, spec_factor=4.0, min_prob=0.5)
    draft = d.propose(max_len=8)
    assert draft.tokens == [3, 4, 5] and draft.probs == pytest.approx([1, 1, 0.6])  # then the outputs end


def test_a_match_seen_very_often_is_counted_on_its_latest_occurrences():
    shared = SharedOutputs()
    for out in [[9, 1, 2, 3]] * 300 + [[9, 1, 2, 4]] * 200:
        shared.add(out)
    draft = SuffixDrafter([9, 1, 2], shared).propose(max_len=1)
    assert draft.tokens == [4] and draft.probs == [200 / 256]  # 3 is the more frequent of all


def test_no_proposal_without_a_match():
    d = SuffixDrafter([1, 2, 3, 4])
    assert d.propose([5, 6]) == ([], [], 0)
    assert d.propose([9, 2]).tokens == []  # one token matches, min_match is 2
    assert d.propose().tokens == []  # its own tail, with nothing after it, is no match
    assert SuffixDrafter([1, 2, 3, 4], min_match=1).propose([9, 2]).tokens == [3]


def test_the_request_index_sees_its_own_output_as_it_grows():
    d = SuffixDrafter([5, 6, 7, 8, 9], spec_factor=4.0)
    d.extend([1, 2, 3])
    assert d.propose(max_len=8).tokens == []
    d.extend([4, 1])
    d.append(2)
    assert d.output() == [1, 2, 3, 4, 1, 2]
    assert d.propose(max_len=8).tokens == [3, 4, 1, 2]


def test_the_shared_index_holds_its_cap_and_evicts_the_oldest_first():
    shared = SharedOutputs(cap_tokens=40, chunks=4)
    outputs = [[100 * k + i for i in range(10)] for k in range(10)]
    first = None
    for out in outputs:
        shared.add(out)
        first = first or weakref.ref(shared.chunks[0])
        assert shared.tokens <= 40
    gc.collect()
    assert first() is None and shared.tokens == 40 and len(shared.chunks) == 4
    for k, out in enumerate(outputs):
        expected = out[2:4] if k >= 6 else []
        assert SuffixDrafter([1], shared, spec_factor=1.0).propose(out[:2]).tokens == expected
    assert shared.nbytes < 4 * 2000  # what it holds, not what it was ever given


def test_a_cleared_shared_index_drafts_nothing_and_counts_nothing():
    shared = SharedOutputs()
    shared.add([5, 6, 7, 8])
    assert SuffixDrafter([1], shared).propose([5, 6]).tokens == [7, 8]
    shared.clear()
    assert shared.tokens == shared.nbytes == 0
    assert SuffixDrafter([1], shared).propose([5, 6]).tokens == []
    shared.add([5, 6, 9])
    assert SuffixDrafter([1], shared).propose([5, 6]).tokens == [9]


def test_requests_are_independent_and_only_outputs_are_shared():
    shared = SharedOutputs()
    a, b = SuffixDrafter([1, 2, 3, 4], shared), SuffixDrafter([9, 8], shared)
    a.extend([5, 6, 7])
    b.extend([1, 2])
    assert b.propose().tokens == [] and b.propose([5, 6]).tokens == []
    a.finish()
    assert shared.tokens == 3  # a's output, not its prompt
    assert b.propose().tokens == [] and b.propose([5, 6]).tokens == [7]
    assert a.propose([1, 2]).tokens == [3, 4]


def test_bad_tokens_are_refused():
    with pytest.raises(ValueError):
        TokenIndex([1, -1, 2])
    with pytest.raises(ValueError):
        SuffixDrafter([1]).append(-1)
    with pytest.raises(ValueError):
        SuffixDrafter([1]).extend([1 << 21])


def _occurrences(seqs, pattern):
    """(sequence, end) of every occurrence of pattern followed by a token, oldest first."""
    k = len(pattern)
    return [(s, e) for s, seq in enumerate(seqs)
            for e in range(k - 1, len(seq) - 1) if seq[e - k + 1:e + 1] == pattern]


def _reference(seqs, ctx, min_match, max_match, factor, min_prob, max_len):
    ctx, length = ctx[-max_match:], 0
    for n in range(min_match, len(ctx) + 1):
        if not _occurrences(seqs, ctx[len(ctx) - n:]):
            break
        length = n
    if length == 0:
        return [], [], 0
    pattern, tokens, probs, prob = ctx[len(ctx) - length:], [], [], 1.0
    while len(tokens) < min(max_len, int(length * factor + 1e-6)):
        nxt = [seqs[s][e + 1] for s, e in _occurrences(seqs, pattern)]
        if not nxt:
            break
        counts = Counter(nxt)
        top = max(counts.values())
        best = [t for t in nxt if counts[t] == top][-1]
        if prob * (top / len(nxt)) < min_prob:
            break
        prob *= top / len(nxt)
        tokens, probs, pattern = tokens + [best], probs + [prob], pattern + [best]
    return tokens, probs, length


def test_random_sequences_match_a_brute_force_reference():
    rng = random.Random(44)
    for _ in range(80):
        alphabet = rng.sample([0, 1, 7, 151_935, (1 << 21) - 2], rng.randint(2, 5))

        def seq(n, alphabet=alphabet):
            return [rng.choice(alphabet) for _ in range(n)]

        min_match = rng.randint(1, 4)
        args = dict(min_match=min_match, max_match=rng.randint(min_match, 9),
                    spec_factor=rng.choice([1.0, 2.5, 8.0]), min_prob=rng.choice([0.0, 0.1, 0.3]))
        shared = SharedOutputs(cap_tokens=10_000, chunks=rng.randint(1, 3), min_match=args["min_match"],
                               max_match=args["max_match"], live_max=rng.randint(0, 6))
        outputs = [seq(rng.randint(0, 12)) for _ in range(rng.randint(0, 4))]
        for out in outputs:
            shared.add(out)
        prompt = seq(rng.randint(0, 20))
        d = SuffixDrafter(prompt, shared, live_max=rng.randint(0, 6), **args)
        text = list(prompt)
        for _ in range(8):
            new = seq(rng.randint(1, 3))
            d.extend(new)
            text += new
            ctx = text if rng.random() < 0.7 else seq(rng.randint(0, 6))
            max_len = rng.randint(1, 12)
            got = d.propose(None if ctx is text else ctx, max_len=max_len)
            want = _reference([o for o in outputs if o] + [text], ctx, args["min_match"],
                              args["max_match"], args["spec_factor"], args["min_prob"], max_len)
            assert (got.tokens, got.match_len) == (want[0], want[2]), (text, ctx, args)
            assert got.probs == pytest.approx(want[1])
