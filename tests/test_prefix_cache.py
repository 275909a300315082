"""PrefixCache on its own: the trie's longest-prefix match, LRU eviction under the byte
budget, and the trie staying consistent with the entries through inserts and removals.
The stored states are tiny ArraysCaches whose byte size the test chooses."""

import gc
import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache

from mlxmtp.engine.prefix.cache import PrefixCache
from mlxmtp.mlxlm.model_cache import ModelCache

NO_LOGITS = mx.zeros((0,), dtype=mx.uint8)
LOGITS = mx.zeros((4,), dtype=mx.uint8)  # 4 bytes


def state(nbytes):
    c = ArraysCache(1)
    c.cache = [mx.zeros((nbytes,), dtype=mx.uint8)]
    return ModelCache([c])


def put(pc, tokens, nbytes=10, logits=NO_LOGITS):
    pc.store(list(tokens), state(nbytes), None, None, [], logits)


def found(pc, prompt):
    entry = pc.lookup(list(prompt))
    return None if entry is None else entry.tokens


def test_longest_prefix_wins():
    pc = PrefixCache(1 << 20)
    for key in [(1, 2), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6), (1, 9), (7,)]:
        put(pc, key)
    assert found(pc, [1, 2, 3, 4, 5, 6, 7]) == (1, 2, 3, 4, 5, 6)
    assert found(pc, [1, 2, 3, 4, 5]) == (1, 2, 3, 4)
    assert found(pc, [1, 2, 3]) == (1, 2)
    assert found(pc, [1, 9, 9]) == (1, 9)
    assert found(pc, [7, 7]) == (7,)  # a one-token prefix counts
    assert found(pc, [1]) is None  # nothing stored is a prefix of it
    assert found(pc, [2, 1]) is None
    assert (pc.hits, pc.misses) == (5, 2)


def test_equal_length_needs_the_logits():
    pc = PrefixCache(1 << 20)
    put(pc, (1, 2))
    put(pc, (1, 2, 3))  # stored without logits: only a strict prefix
    assert found(pc, [1, 2, 3]) == (1, 2)
    assert found(pc, [1, 2, 3, 4]) == (1, 2, 3)
    put(pc, (5, 6), logits=LOGITS)
    assert found(pc, [5, 6]) == (5, 6)


def test_store_copies_the_state_and_counts_its_bytes():
    pc = PrefixCache(1 << 20)
    cache = state(100)
    pc.store([1, 2, 3], cache, state(20), mx.zeros((2, 3), dtype=mx.uint8), [7], LOGITS)
    entry = pc.lookup([1, 2, 3])
    assert entry.cache is not cache and entry.cache[0] is not cache[0]
    assert mx.array_equal(entry.cache[0].cache[0], cache[0].cache[0])
    assert entry.nbytes == pc.bytes == 100 + 20 + 6 + 4
    assert entry.pend_t == [7]


def test_an_entry_stored_from_a_view_owns_only_its_part():
    """A slice of a large array (one row of a batch's state) is stored as its own copy:
    dropping the large array frees it, so the entry holds what its byte count says."""
    pc = PrefixCache(1 << 30)
    big = mx.zeros((8, 1 << 20), dtype=mx.uint8)
    mx.eval(big)
    c = ArraysCache(1)
    c.cache = [big[3:4]]
    gc.collect()
    before = mx.get_active_memory()
    pc.store([1, 2], ModelCache([c]), None, None, [], NO_LOGITS)
    del big, c
    gc.collect()
    assert before - mx.get_active_memory() >= 7 << 20  # the other 7 rows are gone
    assert pc.bytes == 1 << 20


def test_least_recently_used_goes_first():
    pc = PrefixCache(30)
    put(pc, (1,))
    put(pc, (2,))
    put(pc, (3,))
    assert found(pc, [1, 5]) == (1,)  # (1,) is now the most recently used
    put(pc, (4,))  # over budget: the least recently used, (2,), leaves
    assert list(pc.entries) == [(3,), (1,), (4,)]
    assert found(pc, [2]) is None
    put(pc, (3,))  # storing a key again only refreshes it
    put(pc, (5,))
    assert list(pc.entries) == [(4,), (3,), (5,)]
    assert pc.bytes == 30


def test_budget():
    pc = PrefixCache(25)
    put(pc, (1,), nbytes=26)  # larger than the whole budget: not stored
    assert not pc.entries and pc.bytes == 0
    put(pc, (1,), nbytes=10)
    put(pc, (2,), nbytes=10)
    put(pc, (3,), nbytes=20)  # both others must go to fit it
    assert list(pc.entries) == [(3,)] and pc.bytes == 20
    assert found(pc, [1, 1]) is None and found(pc, [3, 3]) == (3,)
    off = PrefixCache(0)
    put(off, (1,))
    assert not off.entries
    put(pc, ())  # an empty sequence is never stored
    assert list(pc.entries) == [(3,)]


def test_eviction_keeps_longer_and_shorter_neighbours():
    pc = PrefixCache(30)
    put(pc, (1, 2, 3))
    put(pc, (1, 2))
    put(pc, (1, 2, 3, 4, 5))
    found(pc, [1, 2, 9])  # refresh (1, 2)
    found(pc, [1, 2, 3, 4, 5, 6])  # refresh (1, 2, 3, 4, 5)
    put(pc, (1, 2, 3, 4))  # evicts (1, 2, 3): a node in the middle of the path
    assert set(pc.entries) == {(1, 2), (1, 2, 3, 4, 5), (1, 2, 3, 4)}
    assert found(pc, [1, 2, 3, 9]) == (1, 2)
    assert found(pc, [1, 2, 3, 4, 9]) == (1, 2, 3, 4)
    assert found(pc, [1, 2, 3, 4, 5, 9]) == (1, 2, 3, 4, 5)


def _nodes(node):
    yield node
    for _, child in node.edges.values():
        yield from _nodes(child)


def test_trie_matches_a_linear_scan_under_random_traffic():
    rng = random.Random(0)
    pc = PrefixCache(200)
    base = [rng.randrange(4) for _ in range(12)]
    for _ in range(600):
        if rng.random() < 0.5:
            n = rng.randrange(1, 12)
            seq = base[:n] + [rng.randrange(4) for _ in range(rng.randrange(3))]
            put(pc, seq, nbytes=rng.randrange(5, 40), logits=LOGITS if rng.random() < 0.5 else NO_LOGITS)
        else:
            prompt = base[:rng.randrange(1, 12)] + [rng.randrange(4) for _ in range(rng.randrange(3))]
            usable = [k for k, e in pc.entries.items() if tuple(prompt[:len(k)]) == k
                      and (len(k) < len(prompt) or e.last_logits.size > 0)]
            want = max(usable, key=len) if usable else None
            assert found(pc, prompt) == want, (prompt, list(pc.entries))
            shared = max([_common(k, prompt) for k in pc.entries] + [0])
            assert pc.shared_length(prompt) == shared, (prompt, list(pc.entries))
        assert pc.bytes == sum(e.nbytes for e in pc.entries.values()) <= 200
        stored = [node.entry.tokens for node in _nodes(pc.trie.root) if node.entry is not None]
        assert sorted(stored) == sorted(pc.entries)
        # Compressed: every node but the root holds an entry or branches.
        assert all(node.entry is not None or len(node.edges) >= 2 for node in _nodes(pc.trie.root)
                   if node is not pc.trie.root)


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_state_that_cannot_be_copied_is_skipped(monkeypatch):
    """The cache only saves work: a failed copy (e.g. no memory) stores nothing and raises
    nothing, except on a distributed engine, whose ranks must hold the same entries."""
    def no_memory(cache):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(ModelCache, "owned_copy", no_memory)
    pc = PrefixCache(1 << 20)
    put(pc, (1, 2, 3))
    assert pc.bytes == 0 and not pc.entries and found(pc, [1, 2, 3, 4]) is None
    pc.agree = lambda n: n
    with pytest.raises(RuntimeError, match="out of memory"):
        put(pc, (1, 2, 3))
