"""Which operations cost more for T query tokens than for one, on this backend?

A verify forward of T tokens evaluates only ~1.25x the operations of a one-token forward
on the demo model (bench/graph_ops.py), yet on an H100 it took 1.5-2x the time. This
times each kind of operation the demo's forward is made of, at the demo's shapes, for
T = 1..5: a chain of N dependent copies evaluated at once, so the time per copy is what
one launch of that operation costs there, launch and device time together.

    python scripts/gpu_op_probe.py            # float16, the demo's shapes
    python scripts/gpu_op_probe.py --reps 5 --chain 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.gated_delta import gated_delta_update

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, CONTEXT = 192, 4, 2, 48, 512, 2048, 128
GDN_K_HEADS, GDN_V_HEADS, GDN_DIM, CONV_KERNEL = 2, 4, 48, 4


def _linear(T, dt):
    w = mx.random.normal((HIDDEN, HIDDEN)).astype(dt) * 0.05
    return mx.random.normal((1, T, HIDDEN)).astype(dt), lambda x: x @ w


def _lm_head(T, dt):
    w = mx.random.normal((VOCAB, HIDDEN)).astype(dt) * 0.05
    back = mx.random.normal((VOCAB, HIDDEN)).astype(dt) * 0.01
    return mx.random.normal((1, T, HIDDEN)).astype(dt), lambda x: (x @ w.T) @ back


def _quantized(T, dt):
    w, s, b = mx.quantize(mx.random.normal((HIDDEN, HIDDEN)).astype(dt) * 0.05, group_size=64, bits=4)
    return mx.random.normal((1, T, HIDDEN)).astype(dt), lambda x: mx.quantized_matmul(x, w, s, b, group_size=64, bits=4)


def _rms_norm(T, dt):
    w = mx.ones((HIDDEN,), dt)
    return mx.random.normal((1, T, HIDDEN)).astype(dt), lambda x: mx.fast.rms_norm(x, w, 1e-6)


def _rope(T, dt):
    return mx.random.normal((1, HEADS, T, HEAD_DIM)).astype(dt), \
        lambda x: mx.fast.rope(x, HEAD_DIM // 4, traditional=False, base=1e4, scale=1.0, offset=CONTEXT)


def _attention(T, dt):
    k = mx.random.normal((1, KV_HEADS, CONTEXT + T, HEAD_DIM)).astype(dt)
    v = mx.random.normal((1, KV_HEADS, CONTEXT + T, HEAD_DIM)).astype(dt)
    mask = None if T == 1 else "causal"
    return mx.random.normal((1, HEADS, T, HEAD_DIM)).astype(dt), \
        lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM ** -0.5, mask=mask)


def _attention_array_mask(T, dt):
    k = mx.random.normal((1, KV_HEADS, CONTEXT + T, HEAD_DIM)).astype(dt)
    v = mx.random.normal((1, KV_HEADS, CONTEXT + T, HEAD_DIM)).astype(dt)
    mask = mx.arange(CONTEXT + T)[None, :] <= (CONTEXT + mx.arange(T))[:, None]
    return mx.random.normal((1, HEADS, T, HEAD_DIM)).astype(dt), \
        lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM ** -0.5, mask=mask)


def _conv(T, dt):
    channels = 2 * GDN_K_HEADS * GDN_DIM + GDN_V_HEADS * GDN_DIM
    w = mx.random.normal((channels, CONV_KERNEL, 1)).astype(dt) * 0.1
    x = mx.random.normal((1, T + CONV_KERNEL - 1, channels)).astype(dt)
    return x, lambda x: mx.concatenate([x[:, : CONV_KERNEL - 1], mx.conv1d(x, w, groups=channels)], axis=1)


def _gated_delta(T, dt):
    q = mx.random.normal((1, T, GDN_K_HEADS, GDN_DIM)).astype(dt) * 0.1
    k = mx.random.normal((1, T, GDN_K_HEADS, GDN_DIM)).astype(dt) * 0.1
    v = mx.random.normal((1, T, GDN_V_HEADS, GDN_DIM)).astype(dt)
    a = mx.random.normal((1, T, GDN_V_HEADS)).astype(dt)
    b = mx.random.normal((1, T, GDN_V_HEADS)).astype(dt)
    a_log, dt_bias = mx.zeros((GDN_V_HEADS,)), mx.zeros((GDN_V_HEADS,))
    state = mx.zeros((1, GDN_V_HEADS, GDN_DIM, GDN_DIM), mx.float32)
    return state, lambda s: gated_delta_update(q, k, v, a, b, a_log, dt_bias, s)[1]


def _argmax(T, dt):
    return mx.random.normal((1, T, VOCAB)).astype(dt), lambda x: x + mx.argmax(x, axis=-1, keepdims=True).astype(dt)


OPS = {"linear 192x192": _linear, "lm_head 192x2048 (and back)": _lm_head, "4-bit linear": _quantized,
       "rms_norm": _rms_norm, "rope": _rope, "attention, causal": _attention,
       "attention, array mask": _attention_array_mask, "conv1d (depthwise)": _conv,
       "gated delta (mlx-lm dispatch)": _gated_delta, "argmax over vocab": _argmax}


def time_chain(make, T, dt, chain, reps):
    """Median microseconds per copy of a chain of `chain` dependent copies."""
    x, op = make(T, dt)
    mx.eval(x)
    times = []
    for _ in range(reps + 1):
        y = x
        t0 = time.perf_counter()
        for _ in range(chain):
            y = op(y)
        mx.eval(y)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times[1:]) / chain


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chain", type=int, default=100)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args()
    dt = getattr(mx, args.dtype)
    sizes = range(1, 6)
    print(f"device: {mx.default_device()}   dtype: {args.dtype}   chain: {args.chain}   reps: {args.reps}")
    print("| operation | T=1 us | " + " | ".join(f"T={T} / T=1" for T in sizes[1:]) + " |")
    print("|---" * len(sizes) + "|---|")
    for name, make in OPS.items():
        us = [time_chain(make, T, dt, args.chain, args.reps) for T in sizes]
        print(f"| {name} | {us[0]:.1f} | " + " | ".join(f"{u / us[0]:.2f}x" for u in us[1:]) + " |")


if __name__ == "__main__":
    main()
