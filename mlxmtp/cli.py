"""`mlxmtp` command line: one click group, each subcommand in the package that owns it."""

from __future__ import annotations

import logging

import click

from . import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlxmtp")
def main():
    """MLX inference with the built-in MTP head of Qwen3-Next / Qwen3.5 / Qwen3.6 as a free drafter."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _register():
    # On use: each subcommand's module is imported only when the CLI runs.
    from .bench_cli import bench
    from .convert.cli import add_mtp_weights
    from .convert.draft_vocab_cli import draft_vocab
    from .engine.cli import generate
    from .models.cli import inspect
    from .server.cli import serve

    for cmd in (serve, generate, bench, inspect, add_mtp_weights, draft_vocab):
        main.add_command(cmd)


_register()

if __name__ == "__main__":
    main()
