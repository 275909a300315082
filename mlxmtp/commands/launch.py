"""`mlxmtp launch`: `mlx.launch` with the same options, without its two faults
(mlxmtp/distributed/launch.py)."""

from __future__ import annotations

import sys

import click


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def launch(args):
    """Run a command on every rank, as `mlx.launch` does, with its options
    (`mlx.launch -h`): `mlxmtp launch --hostfile hosts.json -- mlxmtp serve --model M`.

    Unlike mlx.launch, the launcher idles while the ranks work (mlx.launch keeps a core busy
    polling, for as long as they run), and exits 1 when a rank fails, so a supervisor can
    restart the group (mlx.launch exits 0 whatever its ranks did). The ranks get no input on
    stdin; mlxmtp's commands read none."""
    # On use: `mlxmtp` start-up imports every subcommand module
    from ..distributed.launch import main

    sys.exit(main(args))
