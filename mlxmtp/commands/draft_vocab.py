"""`mlxmtp draft-vocab`: write the token list a trimmed draft vocabulary drafts from."""

from __future__ import annotations

from pathlib import Path

import click

from ..mlxlm.loading import load_config, load_tokenizer

TOKENIZER_FILES = ["*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja", "*.py"]


def _tokenizer_and_config(model: str):
    """(model folder, mlx-lm tokenizer with the model's EOS ids, config); a Hugging Face
    repo id downloads the tokenizer and configs only."""
    # On use: `mlxmtp` start-up imports every subcommand module.
    from ..models import demo
    from ..models.errors import ModelLoadError
    from ..models.hub import hub_snapshot
    from ..models.model_folder import check_model_folder

    path = Path(demo.resolve(model)).expanduser()  # the demo: by default, or by its name
    try:
        if not path.exists():
            path = hub_snapshot(model, TOKENIZER_FILES)
        check_model_folder(path, weights=False)
        config = load_config(path)  # merges generation_config's eos_token_id, as mlx_lm.load does
        return path, load_tokenizer(path, eos_token_ids=config.get("eos_token_id")), config
    except ModelLoadError as e:
        raise click.ClickException(str(e)) from e
    except (OSError, ValueError) as e:  # not a model folder: no config.json, or no tokenizer
        raise click.ClickException(f"cannot read a model's config and tokenizer in {path}: {e}") from e


@click.command("draft-vocab")
@click.option("--model", default=None,
              help="Model folder (or Hugging Face repo id, with --out; default: the demo model, with --out).")
@click.option("--corpus", "corpus", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="UTF-8 text file to count tokens in (repeatable; more files may follow as arguments).")
@click.argument("more", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--size", required=True, type=click.IntRange(min=1), help="Tokens in the list (e.g. 32768).")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Where to write the list (default: MODEL/mtp/draft_vocab.json; required for the demo model).")
def draft_vocab(model, corpus, more, size, out):
    """Write the special tokens and the corpus's most frequent tokens as the MTP head's draft
    vocabulary (used with --draft-vocab N on serve / generate; N up to --size)."""
    # On use: `mlxmtp` start-up imports every subcommand module, and these pull in mlx.
    from ..checkpoint import token_list
    from ..mlxlm.family import text_config
    from ..models import demo

    files = [Path(f) for f in (*corpus, *more)]
    if not files:
        raise click.UsageError("give at least one --corpus file")
    if out is None and demo.names_demo(model):
        raise click.UsageError("the demo model is part of the mlxmtp package, which this command does not write "
                               "to: give --out PATH (its 2048-token vocabulary is below the 64K tokens a draft "
                               "vocabulary is trimmed from, so serve --draft-vocab leaves it whole)")
    path, tok, config = _tokenizer_and_config(model)
    if out is None:
        out = token_list.default_path(path)
        if out is None:
            raise click.UsageError(f"{path} has no mtp/ folder to put the list in: give --out PATH")
    try:
        ids, meta = token_list.make_token_list(tok, files, size, text_config(config)["vocab_size"])
        token_list.write_token_list(Path(out), ids, meta)
    except (token_list.DraftVocabError, OSError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"wrote {out}: {len(ids)} tokens ({meta['num_special']} special) from "
               f"{meta['corpus_tokens']} corpus tokens in {len(files)} file(s)")
