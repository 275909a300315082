"""`mlxmtp launch`: MLX's own launcher (`mlx.launch`, same options), idle while its ranks work
and failing when one of them fails.

mlx.launch forwards its input to every rank and relays their output. Each rank's relay asks on
every turn of its loop whether the rank's input can take more, whether or not there is input
to forward; a pipe with room always can, so every relay spins, and at the end of the launcher's
own input (/dev/null, as a supervisor starts it) its main loop spins too. The launcher then
burns a core for as long as the ranks run, on the machine it was started from. And it exits 0
whatever its ranks did, so a supervisor never learns that the group failed.

mlxmtp's commands read no input. So this runs mlx.launch's own code with three changes: its
input is a pipe nothing is ever written to, its relays wait on the ranks' output alone, and
the exit status is 1 when a rank exited non-zero or was killed. The changes replace names in
mlx.launch's module (`select`, `_launch_with_io`): where a later MLX lacks them, its launcher
runs as it is.
"""

from __future__ import annotations

import os
import select as _select
import sys
from typing import List, Sequence


def _wait_for_output(rlist, wlist, xlist, timeout=None):
    """mlx.launch's poll with the ranks' input left out: nothing is ever forwarded to them."""
    ready, _, errors = _select.select(rlist, [], xlist, timeout)
    return ready, [], errors


def _recording_exits(launch_with_io, statuses: List[tuple]):
    """mlx.launch's `_launch_with_io`, keeping each rank's (exit code, killed) in `statuses`:
    the launcher reads a rank's `exit_status` once, when its relay ends."""

    def run(command_class, arguments, verbose):
        class Recorded(command_class):
            @property
            def exit_status(self):
                status = super().exit_status
                statuses.append(status)
                return status

        return launch_with_io(Recorded, arguments, verbose)

    return run


def _idle_input() -> None:
    """Make this process's stdin a pipe that stays open and empty (its write end is never
    closed), so the launcher's poll of it waits instead of reading end of file at once."""
    read_end, _held = os.pipe()
    os.dup2(read_end, sys.stdin.fileno())


def main(argv: Sequence[str]) -> int:
    """Run mlx.launch with `argv` (its options, `--`, the command); 1 if a rank failed."""
    from mlx._distributed_utils import launch as mlx_launch  # the module behind mlx.launch

    statuses: List[tuple] = []
    _idle_input()
    if hasattr(mlx_launch, "select"):
        mlx_launch.select = _wait_for_output
    if hasattr(mlx_launch, "_launch_with_io"):
        mlx_launch._launch_with_io = _recording_exits(mlx_launch._launch_with_io, statuses)
    sys.argv = ["mlx.launch", *argv]
    mlx_launch.main()
    return 1 if any(killed or code not in (0, None) for code, killed in statuses) else 0
