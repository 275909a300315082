"""Time to first token of a long prompt: prefilled, loaded from the prefix cache's folder
on disk by a new engine (what a restarted server, or one whose memory evicted the state,
does with `serve --prefix-cache-dir`), and found in memory; and the time to write the state
(synced to the disk), which a server spends when it stops or evicts it.

    python bench/prefix_disk.py [--model PATH] [--tokens 4000,8000] [--rounds 3] [--large-tokens 20000]

Each round takes another prompt (the demo's code prompts, repeated and rotated) and a new
folder; the three times are measured in that round, and the table gives their medians and
the median of each round's ratio. The first token is checked to be the same all three ways.
Before the state is loaded its files are dropped from the system's page cache (Linux), so
they are read from the disk. The demo's state is small (2 attention layers of 8); a second
table writes and reads states of Qwen3.5-27B's shapes (random values) through the same store.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.prefix.cache import PrefixEntry
from mlxmtp.engine.prefix.disk import DiskPrefixStore
from mlxmtp.engine.request import Request
from mlxmtp.mlxlm.model_cache import ModelCache
from mlxmtp.mlxlm.ragged_cache import RaggedKVCache
from mlxmtp.models.demo_prompts import HELD_OUT_PROMPTS
from mlxmtp.models.load import load


def long_prompt(tok, n: int, rotate: int) -> list:
    texts = list(HELD_OUT_PROMPTS.values())
    texts = texts[rotate % len(texts):] + texts[: rotate % len(texts)]
    ids: list = []
    while len(ids) < n:
        ids += tok.encode("\n\n".join(texts))
    return ids[:n]


def first_token(eng: BatchGenerator, prompt: list):
    """(seconds from submit to the first token, that token)."""
    t0 = time.perf_counter()
    eng.submit(Request(prompt=prompt, max_tokens=1))
    token = None
    while eng.has_work:
        for ev in eng.step():
            token = ev.token_ids[0] if ev.token_ids else token
    return time.perf_counter() - t0, token


def drop_from_page_cache(folder: Path) -> None:
    """Make the next read of the files come from the disk, not from the memory the system
    kept them in after writing (as after a reboot, or once other files pushed them out)."""
    if not hasattr(os, "posix_fadvise"):  # macOS: `sudo purge` does it for the whole machine
        return
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def engine(model, tok, folder: Path) -> BatchGenerator:
    return BatchGenerator(model, tok, EngineConfig(prefix_cache_bytes=4 << 30, prefix_cache_dir=str(folder),
                                                   prefix_cache_disk_mb=16 << 10))


def one_round(model, tok, n: int, rotate: int) -> dict:
    prompt = long_prompt(tok, n, rotate)
    with tempfile.TemporaryDirectory() as folder:
        first = engine(model, tok, Path(folder))
        cold, t1 = first_token(first, prompt)
        t0 = time.perf_counter()
        first.prefix_cache.save_to_disk()  # as a stopping server does (and memory evicting it)
        write = time.perf_counter() - t0
        mib = first.prefix_cache.disk.bytes / 2**20
        drop_from_page_cache(first.prefix_cache.disk.folder)
        restarted = engine(model, tok, Path(folder))
        disk, t2 = first_token(restarted, prompt)
        memory, t3 = first_token(restarted, prompt)
        assert t1 == t2 == t3, (t1, t2, t3)
        assert restarted.prefix_cache.disk.loads == 1
    return {"cold": cold, "write": write, "disk": disk, "memory": memory, "mib": mib}


def qwen35_27b_state(tokens: int):
    """A PrefixEntry of Qwen3.5-27B's shapes after `tokens` tokens (random bf16 KV, float32
    Gated DeltaNet states): 16 attention layers of 4 KV heads of 256 (64 KiB a token), 48
    Gated DeltaNet layers (48 value heads of 128 x 128)."""
    layers = ModelCache()
    for i in range(64):
        if i % 4 == 3:
            c = RaggedKVCache(1)
            c.keys, c.values = (mx.random.normal((1, 4, tokens, 256)).astype(mx.bfloat16) for _ in range(2))
            c.lengths = [tokens]
            layers.append(c)
        else:
            c = ArraysCache(2)
            c.cache = [mx.random.normal((1, 3, 10240)).astype(mx.bfloat16), mx.random.normal((1, 48, 128, 128))]
            layers.append(c)
    mx.eval(*layers.arrays())
    nbytes = layers.nbytes
    return PrefixEntry(tuple(range(tokens)), layers, None, None, [], mx.zeros((0,)), nbytes)


def large_state_round(tokens: int) -> dict:
    """Write a Qwen3.5-27B-sized state to disk and read it back (from the disk, not the page
    cache), checksums included: seconds each, and the bytes."""
    entry = qwen35_27b_state(tokens)
    with tempfile.TemporaryDirectory() as folder:
        # The state is its own model's: what a loaded state's shapes are checked against.
        store = DiskPrefixStore(Path(folder), 64 << 30, "bench", lambda: entry)
        t0 = time.perf_counter()
        store.save(entry)
        write = time.perf_counter() - t0
        drop_from_page_cache(store.folder)
        t0 = time.perf_counter()
        loaded = store.load(store.entries[entry.tokens])
        read = time.perf_counter() - t0
        assert loaded is not None and mx.array_equal(loaded.cache[3].keys, entry.cache[3].keys)
        return {"gib": store.bytes / 2**30, "write": write, "read": read}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", default="4000,8000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--large-tokens", default="20000",
                    help="also write and read Qwen3.5-27B-sized states of these lengths ('' for none)")
    args = ap.parse_args()
    model, tok = load(args.model)
    print("| prompt tokens | state on disk | written in | prefilled | from disk | from memory | prefilled / from disk |")
    print("|---|---|---|---|---|---|---|")
    for n in [int(x) for x in args.tokens.split(",") if x]:
        rows = [one_round(model, tok, n, r) for r in range(args.rounds)]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        ratios = [r["cold"] / r["disk"] for r in rows]
        print(f"| {n} | {med['mib']:.0f} MiB | {med['write']:.3f} s | {med['cold']:.2f} s | {med['disk']:.3f} s | "
              f"{med['memory']:.3f} s | "
              f"{statistics.median(ratios):.0f}x ({min(ratios):.0f}-{max(ratios):.0f}) |")
    if args.large_tokens:
        print("\n| Qwen3.5-27B-sized state | on disk | written in (synced) | read in (from the disk) |")
        print("|---|---|---|---|")
        for n in [int(x) for x in args.large_tokens.split(",")]:
            rows = [large_state_round(n) for _ in range(args.rounds)]
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print(f"| {n} tokens | {med['gib']:.2f} GiB | {med['write']:.2f} s ({med['gib'] / med['write']:.1f} GiB/s) "
                  f"| {med['read']:.2f} s ({med['gib'] / med['read']:.1f} GiB/s) |")


if __name__ == "__main__":
    main()
