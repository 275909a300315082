"""`mlxmtp` command line: one click group, each subcommand in a module of its own here."""

from __future__ import annotations

import logging

import click

from .. import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlxmtp")
def main():
    """MLX inference with the built-in MTP head of Qwen3-Next / Qwen3.5 / Qwen3.6 as a free drafter."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _register():
    # On use: each subcommand's module is imported only when the CLI runs.
    from .add_mtp_weights import add_mtp_weights
    from .bench import bench
    from .draft_vocab import draft_vocab
    from .generate import generate
    from .inspect import inspect
    from .launch import launch
    from .serve import serve

    for cmd in (serve, generate, bench, inspect, add_mtp_weights, draft_vocab, launch):
        main.add_command(cmd)


_register()

if __name__ == "__main__":
    main()
