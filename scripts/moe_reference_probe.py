"""Does a model's state depend on how its tokens were split into forwards? A probe for the
MoE fixture's rollback test on a GPU backend, where the engine's caches (prefill, then
verifies of a few tokens) differed from its reference (one forward over every token) by
far more than rounding, while greedy output was identical.

The same tokens go through stock mlx-lm in forwards of several sizes, and each way's caches
are compared with those of a plain decoder (the prompt, then one token at a time). mlx-lm's
SwitchGLU sorts the token-expert pairs of a forward when there are 64 or more and then
takes another gather_mm path, so with 2 experts per token: one forward over all tokens and
chunks of 32 are sorted, chunks of 31 and of 8 are not. Both failing GPU tests compare
forwards split differently on the MoE fixture (the rollback test's reference is one
forward; the batch test prefills in chunks of 64 where mlx-lm's reference takes each
prompt whole). Printed: the largest difference of each layer's state. On the CPU every
way agrees to rounding.

    python scripts/moe_reference_probe.py [--family qwen3_6_moe] [--tokens 50]
"""

from __future__ import annotations

import argparse
import tempfile

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlxmtp.testing import fixtures as fx


def caches_after(model, tokens, chunks):
    """The model's caches after `tokens`, fed in forwards of the given sizes."""
    cache, i = make_prompt_cache(model), 0
    for n in chunks:
        model(mx.array(tokens[i : i + n])[None], cache=cache)
        i += n
    mx.eval([c.state for c in cache])
    return cache


def layer_states(cache):
    """One array per layer: Gated DeltaNet's recurrent state, or attention's keys."""
    out = []
    for c in cache:
        if hasattr(c, "keys"):
            out.append(np.array(c.keys[..., : c.offset, :]))
        else:
            out.append(np.array(c.cache[1]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwen3_6_moe")
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--prompt", type=int, default=12)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(0, 290, args.tokens)]
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = mlx_lm.load(str(fx.build_variant(args.family, tmp, bits=())["hf"]))
    n, p = args.tokens, args.prompt
    plain = layer_states(caches_after(model, tokens, [p] + [1] * (n - p)))
    ways = {"one forward": [n]}
    for size in (32, 31, 8):
        ways[f"chunks of {size}"] = [size] * (n // size) + ([n % size] if n % size else [])
    print(f"device: {mx.default_device()}   family: {args.family}   tokens: {n} (prompt {p}, then one at a time)")
    print("| way | " + " | ".join(f"layer {i}" for i in range(len(plain))) + " |")
    print("|---|" + "---|" * len(plain))
    for name, chunks in ways.items():
        diffs = [np.abs(a - b).max() for a, b in zip(layer_states(caches_after(model, tokens, chunks)), plain)]
        print(f"| {name} | " + " | ".join(f"{d:.1e}" for d in diffs) + " |")


if __name__ == "__main__":
    main()
