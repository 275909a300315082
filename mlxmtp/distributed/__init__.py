"""Serving one model across machines: `mlx.launch ... -- mlxmtp serve|generate`.

Built on MLX's own distributed layer (`mlx.core.distributed`, launched by `mlx.launch`)
and mlx-lm's own pipeline split. Every rank runs the same engine on its share of the
layers (SPMD, as mlx-lm's server does), built by engine/build.py with this rank's
coordinator (coordinator.py: rank 0's sizes, depth policy and a digest of every cycle's
tokens): rank 0 takes the requests and hands each step's changes to the others (engine.py,
a driver around the engine), every decision that reads a clock is rank 0's
(shared_policy.py), and a rank that dies or stalls ends the run within a timeout
(watchdog.py). load.py loads this rank's share, as checkpoint/split_plan.py plans it.
"""
