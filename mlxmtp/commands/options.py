"""The command-line options `mlxmtp serve` and `mlxmtp generate` share: how the engine drafts,
fine-tuned adapters, the tokenizer, and mlx-lm's options that mlxmtp refuses (users coming
from `mlx_lm.server` / `mlx_lm.generate` type them; each says why it has no place here)."""

from __future__ import annotations

import click

from ..engine.limits import MAX_DRAFT_DEPTH
from ..engine.sampling.params import RANGES


def sampling_range(name: str, kind=click.FloatRange):
    """The click type of a sampling option: `kind` over the engine's range of the field
    `name` (engine/sampling/params.py), checked before the model loads."""
    rule = RANGES[name]
    return kind(rule.low, rule.high, min_open=rule.low_open, max_open=rule.high_open)


POLICY_STATE_DIR = "~/.cache/mlxmtp/policy"  # expanded where it is used (engine/policy/saved.py)


def state_folder(value: str):
    """--policy-state-dir's folder, or None for 'none' (EngineConfig.policy_state_dir)."""
    return None if value.strip().lower() in ("", "none") else value


_DRAFTING = [
    click.option("--num-draft", "--num-draft-tokens", "num_draft", default=None,
                 type=click.IntRange(0, MAX_DRAFT_DEPTH),
                 help="Pin the MTP head's draft depth (default: adaptive); suffix drafts go on unless --no-suffix. "
                      "--num-draft-tokens is mlx-lm's name for it."),
    click.option("--suffix/--no-suffix", default=True, show_default=True,
                 help="Beside the MTP head, draft what the prompt and the output say comes next (up to 32 tokens "
                      "where text repeats: an edit re-emitting code it read); used per row where it promises more."),
    click.option("--draft-vocab", default=0, show_default=True, type=click.IntRange(min=0),
                 help="Draft from the N most frequent tokens only (list made by `mlxmtp draft-vocab`; "
                      "vocabularies over 64K; 0 = the full vocabulary)."),
    click.option("--draft-vocab-file", default=None, type=click.Path(dir_okay=False),
                 help="The token list for --draft-vocab (default: MODEL/mtp/draft_vocab.json)."),
    click.option("--policy-state-dir", default=POLICY_STATE_DIR, show_default=True, envvar="MLXMTP_POLICY_STATE_DIR",
                 help="Where the adaptive depth policy keeps what it learnt (cycle costs on this machine, the head's "
                      "acceptance) for the next run of the same model and settings, so that it starts warm; "
                      "'none': learn afresh every run. Also MLXMTP_POLICY_STATE_DIR."),
    click.option("--compile-steps", is_flag=True,
                 help="Run the MTP head's steps and the accept step as compiled graphs (their shapes are "
                      "fixed on shape-stable caches, the GPU default). Experimental: see BENCHMARKS.md."),
    click.option("--pipeline-drafts", is_flag=True,
                 help="Pipeline drafting cycles: build each on the previous one before reading it "
                      "(shape-stable caches). Experimental: see BENCHMARKS.md for what it costs and saves."),
]

_TOKENIZER = [
    click.option("--trust-remote-code", is_flag=True,
                 help="Let the tokenizer run code from the model's folder (transformers' trust_remote_code), "
                      "as mlx-lm's option does."),
    click.option("--use-default-chat-template", is_flag=True,
                 help="When the tokenizer has no chat template, use its default_chat_template, as mlx-lm's "
                      "option does; start-up fails if it has none either (transformers no longer gives tokenizers one). "
                      "serve's --chat-template wins over it."),
]

_NO_KV_QUANTIZATION = ("mlxmtp keeps its caches unquantized (only a quarter of these hybrid models' layers, "
                       "Qwen3.5 / Qwen3-Next, keep attention KV; the others hold a fixed-size Gated DeltaNet state)")
# mlx-lm's options without an equivalent here -> why.
REFUSED = {
    "--draft-model": "mlxmtp drafts with the model's own MTP head, not a second model: pin its depth with "
                     "--num-draft (or leave it adaptive), require the head with --enable-mtp",
    "--kv-bits": _NO_KV_QUANTIZATION,
    "--kv-group-size": _NO_KV_QUANTIZATION,
    "--quantized-kv-start": _NO_KV_QUANTIZATION,
}


def drafting_options(command):
    """`command` with the drafting options, in the order listed above."""
    for option in reversed(_DRAFTING):
        command = option(command)
    return command


def tokenizer_options(command):
    """`command` with --trust-remote-code and --use-default-chat-template (`models.load`'s
    `trust_remote_code` and `use_default_chat_template`)."""
    for option in reversed(_TOKENIZER):
        command = option(command)
    return command


def refused_option(name: str, why: str):
    """A hidden option `name` (taking a value) that fails the command line, before anything
    loads, with a usage error saying `why` it is not supported."""

    def refuse(ctx, param, value):
        if value is not None:
            raise click.UsageError(f"{name} is not supported: {why}.", ctx=ctx)

    return click.option(name, default=None, hidden=True, expose_value=False, callback=refuse)


def refused_options(command):
    """`command` with a refused_option for each of REFUSED (name -> why)."""
    for name, why in REFUSED.items():
        command = refused_option(name, why)(command)
    return command


ADAPTER_PATH = click.option(
    "--adapter-path", default=None, type=click.Path(exists=True, file_okay=False),
    help="Fine-tuned adapters (an `mlx_lm.lora` output folder) to apply to the model, as mlx-lm does.")
