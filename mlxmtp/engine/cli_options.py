"""The command-line options `mlxmtp serve` and `mlxmtp generate` share: how the engine drafts,
and fine-tuned adapters."""

from __future__ import annotations

import click

from .limits import MAX_DRAFT_DEPTH

_DRAFTING = [
    click.option("--num-draft", default=None, type=click.IntRange(0, MAX_DRAFT_DEPTH),
                 help="Pin the draft depth (default: adaptive)."),
    click.option("--draft-vocab", default=0, show_default=True, type=click.IntRange(min=0),
                 help="Draft from the N most frequent tokens only (list made by `mlxmtp draft-vocab`; "
                      "vocabularies over 64K; 0 = the full vocabulary)."),
    click.option("--draft-vocab-file", default=None, type=click.Path(dir_okay=False),
                 help="The token list for --draft-vocab (default: MODEL/mtp/draft_vocab.json)."),
    click.option("--compile-steps", is_flag=True,
                 help="Run the MTP head's steps and the accept step as compiled graphs (their shapes are "
                      "fixed on shape-stable caches, the GPU default). Experimental: see BENCHMARKS.md."),
    click.option("--pipeline-drafts", is_flag=True,
                 help="Pipeline drafting cycles: build each on the previous one before reading it "
                      "(shape-stable caches). Experimental: see BENCHMARKS.md for what it costs and saves."),
]


def drafting_options(command):
    """`command` with the drafting options, in the order listed above."""
    for option in reversed(_DRAFTING):
        command = option(command)
    return command


ADAPTER_PATH = click.option(
    "--adapter-path", default=None, type=click.Path(exists=True, file_okay=False),
    help="Fine-tuned adapters (an `mlx_lm.lora` output folder) to apply to the model, as mlx-lm does.")
