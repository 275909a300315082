"""What rolling one Gated DeltaNet layer back costs after a partly accepted verify of T
positions: replaying the recurrence over the kept positions through mlx-lm's dispatch (how a
record made by a fused kernel rolls back) against selecting a state the verify recorded
(how a record made by mlx-lm's ops path rolls back: CUDA, the CPU). Graph nodes of the
rollback (a small model's cycle on a GPU is bound by kernel launches) and median ms to
build and evaluate it, for the demo model's layer shape and a Qwen3.5-4B-shaped one,
random inputs, rows keeping 1 of T positions (host-known counts, as a synchronous cycle
has them; "unread" is a pipelined cycle's [B] array on the device).

    python bench/gdn_rollback.py [--reps 30]
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from mlx_lm.models import gated_delta
from sampling_ops import measure

from mlxmtp.mlxlm import gdn_capture

# (name, Hk, Hv, Dk = Dv) of the linear-attention layers
SHAPES = [("demo", 2, 4, 48), ("Qwen3.5-4B", 16, 32, 128)]


def verify_record(B: int, T: int, Hk: int, Hv: int, D: int) -> gdn_capture.LayerRecord:
    """One layer's record of a verify over T positions (the ops path: states recorded)."""
    keys = iter(mx.random.split(mx.random.key(0), 6))
    q, k = (mx.random.normal((B, T, Hk, D), key=next(keys)) * 0.1 for _ in range(2))
    v = mx.random.normal((B, T, Hv, D), key=next(keys))
    a, b = (mx.random.normal((B, T, Hv), key=next(keys)) for _ in range(2))
    A_log, dt_bias = mx.zeros((Hv,)), mx.zeros((Hv,))
    state = mx.random.normal((B, Hv, D, D), key=next(keys)) * 0.1
    with gdn_capture.record() as rec:
        gdn_capture._recording_update(q, k, v, a, b, A_log, dt_bias, state)
    layer = rec.layers[0]
    mx.eval(layer.final_state, *layer.states)
    return layer


def row(layer: gdn_capture.LayerRecord, B: int, unread: bool, reps: int):
    """(replay nodes, ms, select nodes, ms) for rows keeping 1 position each."""
    kept = mx.array([1] * B) if unread else [1] * B
    replay = measure(lambda: [layer._replay(kept if unread else mx.array(kept))], reps)
    select = measure(lambda: [layer._select(kept, not unread)], reps)
    return (*replay, *select)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    # No model here: only the hook on the dispatch's ops path (what install() adds to it).
    gated_delta.gated_delta_ops = gdn_capture._recording_ops
    print("| layer | rows | T | kept | replay: nodes | ms | select: nodes | ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name, Hk, Hv, D in SHAPES:
        for B in (1, 8):
            for T in (2, 4):
                layer = verify_record(B, T, Hk, Hv, D)
                for unread in (False, True):
                    rn, rms, sn, sms = row(layer, B, unread, args.reps)
                    print(f"| {name} | {B} | {T} | {'unread' if unread else 'host'} | {rn} | {rms:.2f} "
                          f"| {sn} | {sms:.2f} |")


if __name__ == "__main__":
    main()
