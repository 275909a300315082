"""`mlxmtp generate`: one prompt, printed like `mlx_lm generate`, or as JSON."""

from __future__ import annotations

import json
import sys
import time

import click

from ..engine.config import EngineConfig
from .options import (
    ADAPTER_PATH,
    POLICY_STATE_DIR,
    drafting_options,
    refused_options,
    sampling_range,
    state_folder,
    tokenizer_options,
)

# The options that set SamplingParams' fields (its errors name the field first).
SAMPLING_OPTIONS = {"temperature": "--temp", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
                    "seed": "--seed"}


@click.command()
@click.option("--model", default=None, help="Model folder or Hugging Face repo id (default: the demo model, mlxmtp-demo).")
@click.option("--prompt", "-p", required=True, help="Prompt text ('-' reads stdin).")
@click.option("--max-tokens", "-m", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--temp", default=0.0, show_default=True, type=sampling_range("temperature"))
@click.option("--top-p", default=1.0, show_default=True, type=sampling_range("top_p"))
@click.option("--top-k", default=0, show_default=True, type=sampling_range("top_k", click.IntRange))
@click.option("--min-p", default=0.0, show_default=True, type=sampling_range("min_p"))
@click.option("--seed", default=None, type=int)
@click.option("--enable-mtp/--disable-mtp", default=True, show_default=True)
@drafting_options
@ADAPTER_PATH
@click.option("--mtp-fallback", is_flag=True, help="Run without MTP if the model has no head.")
@click.option("--no-chat-template", is_flag=True, help="Feed the prompt as raw text.")
@tokenizer_options
@click.option("--profile", is_flag=True, help="Split device time into draft and verify (one more sync per cycle).")
@click.option("--dist-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Under mlx.launch: seconds a step may wait on the other ranks before the run fails.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@refused_options
def generate(model, prompt, max_tokens, temp, top_p, top_k, min_p, seed, enable_mtp, num_draft,
             mtp_fallback, no_chat_template, profile, as_json, draft_vocab=0, draft_vocab_file=None,
             pipeline_drafts=False, compile_steps=False, dist_timeout=30.0, adapter_path=None,
             trust_remote_code=False, use_default_chat_template=False, suffix=True, policy_state_dir=POLICY_STATE_DIR):
    """Generate a completion for the --prompt text (on every rank under `mlx.launch`; rank 0 prints)."""
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    from ..distributed.group import launched_group
    from ..engine.sampling.params import SamplingParams

    if prompt == "-":
        prompt = sys.stdin.read()
    if not enable_mtp and num_draft is not None:
        click.echo("warning: --num-draft has no effect with --disable-mtp", err=True)
    group = launched_group()
    config = EngineConfig(enable_mtp=enable_mtp, num_draft=num_draft, profile=profile, pipeline_drafts=pipeline_drafts,
                          compile_steps=compile_steps, suffix_drafts=suffix,
                          policy_state_dir=state_folder(policy_state_dir))
    m, tok, plan = _load(model, group, config, mtp=enable_mtp, mtp_fallback=mtp_fallback,
                         draft_vocab=draft_vocab, draft_vocab_file=draft_vocab_file, adapter_path=adapter_path,
                         trust_remote_code=trust_remote_code, use_default_chat_template=use_default_chat_template)
    ids, max_tokens = _prompt_ids(m, tok, prompt, not no_chat_template, max_tokens)
    params = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                            reproducible=seed is not None)
    try:
        params.validate(m.parts.args.vocab_size)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise click.BadParameter(str(e), param_hint=SAMPLING_OPTIONS.get(field)) from e
    t0 = time.perf_counter()
    res = _run(m, tok, ids, group, plan, dist_timeout, config, max_tokens=max_tokens, params=params)
    if res is None:
        return  # a rank other than 0: rank 0 reports
    stats = res.stats.as_dict()
    stats["wall_seconds"] = time.perf_counter() - t0
    stats["mtp_active"] = bool(enable_mtp and m.active)
    if group is not None:
        stats["distributed"] = res.distributed
    _report(res, stats, m, profile, as_json)


def _prompt_ids(m, tok, prompt: str, chat_template: bool, max_tokens: int):
    """(token ids, max_tokens capped at the room the model's context leaves): the prompt
    through the chat template, where the model has one and it is wanted."""
    if chat_template and tok.chat_template is not None:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    else:
        ids = tok.encode(prompt)
    if not ids:
        raise click.BadParameter("the prompt is empty", param_hint="--prompt")
    context = m.parts.args.max_position_embeddings
    if len(ids) >= context:
        raise click.BadParameter(f"the prompt's {len(ids)} tokens fill the model's context of {context}",
                                 param_hint="--prompt")
    if max_tokens > context - len(ids):
        click.echo(f"warning: --max-tokens {max_tokens} capped at {context - len(ids)}, the room the model's "
                   f"context of {context} tokens leaves", err=True)
    return ids, min(max_tokens, context - len(ids))


def _report(res, stats: dict, m, profile: bool, as_json: bool) -> None:
    """Print the result: one JSON object, or text as `mlx_lm generate` prints it."""
    if as_json:
        click.echo(json.dumps({"text": res.text, "prompt_tokens": res.prompt_tokens, "token_ids": res.token_ids,
                               "finish_reason": res.finish_reason, "stats": stats}))
        return
    click.echo("=" * 10)
    click.echo(res.text)
    click.echo("=" * 10)
    click.echo(f"Prompt: {res.prompt_tokens} tokens, {res.prompt_tokens / max(stats['prefill_seconds'], 1e-9):.1f} tokens-per-sec")
    click.echo(f"Generation: {stats['generated_tokens']} tokens, {stats['tokens_per_second']:.1f} tokens-per-sec")
    if stats["mtp_active"]:
        by_pos = ", ".join(f"{a:.0%}" for a in stats["acceptance_by_position"])
        click.echo(f"MTP: drafted {stats['drafted']}, accepted {stats['accepted']} ({stats['acceptance']:.0%}; by position: {by_pos}), "
                   f"{stats['tokens_per_forward']:.2f} tokens/forward, depths {stats['depths']}")
        t = stats["time"]
        click.echo(f"Time: draft {t['draft']:.3f}s, verify {t['verify']:.3f}s, overhead {t['overhead']:.3f}s"
                   + ("" if profile else " (draft is inside verify without --profile)"))
    else:
        click.echo("MTP: off" + (f" ({m.disabled_reason})" if m.disabled_reason else ""))


def _load(model, group, config: EngineConfig, **load_options):
    """(model, tokenizer, plan): the whole model, or this rank's share under mlx.launch
    (every rank checked to have rank 0's engine `config` and `load_options`)."""
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    from ..distributed.group import SetupMismatchError
    from ..models.errors import MissingMTPHeadError, ModelLoadError
    from ..models.load import load

    try:
        if group is None:
            return (*load(model, **load_options), None)
        from ..distributed.load import load_on_rank  # on use, as above

        return load_on_rank(group, model, config, **load_options)
    except MissingMTPHeadError as e:  # generate uses the head by default: say how not to
        raise click.ClickException(f"{e} Or generate without MTP: add --disable-mtp, or --mtp-fallback to use "
                                   "the head only where a model has one.") from e
    except (ModelLoadError, SetupMismatchError) as e:
        raise click.ClickException(str(e)) from e


def _run(m, tok, ids, group, plan, dist_timeout: float, config: EngineConfig, **generate_options):
    """The result: alone, or rank 0 of a distributed run; None on the other ranks (every
    rank's engine built from `config`)."""
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    from ..engine.generate import generate as run

    if group is None:
        return run(m, tok, ids, config=config, **generate_options)
    from ..distributed.run import generate_on_ranks  # on use, as above

    return generate_on_ranks(group, plan, m, tok, ids, dist_timeout=dist_timeout, config=config, **generate_options)
