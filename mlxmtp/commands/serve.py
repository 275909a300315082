"""`mlxmtp serve`: load a model (the packaged demo model by default) and serve it.

The options make two config objects, once: the EngineConfig every rank builds its engine
from (rank 0 behind the app, the others following it), and the ServerConfig of the app."""

from __future__ import annotations

import functools
import logging

import click

from ..engine.config import EngineConfig
from ..engine.limits import PREFILL_STEP, PREFIX_DISK_MB
from ..server.config import ServerConfig
from . import serve_options
from .options import (
    ADAPTER_PATH,
    POLICY_STATE_DIR,
    drafting_options,
    refused_options,
    sampling_range,
    state_folder,
    tokenizer_options,
)

log = logging.getLogger("mlxmtp.server")


@click.command()
@click.option("--model", default=None, help="Model folder or Hugging Face repo id (default: the packaged demo model, mlxmtp-demo).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (local only by default).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option("--enable-mtp/--disable-mtp", default=None,
              help="Require the MTP head (error if missing, unless --mtp-fallback) / never use it. "
                   "Default: use the head when the model has one.")
@drafting_options
@ADAPTER_PATH
@click.option("--mtp-fallback", is_flag=True, help="With --enable-mtp: serve without MTP if the model has no head.")
@click.option("--max-concurrent", "--decode-concurrency", "max_concurrent", default=8, show_default=True,
              type=click.IntRange(min=1),
              help="Requests decoded together; more wait in the queue. --decode-concurrency is mlx-lm's name.")
@click.option("--max-prompt-tokens", default=None, type=click.IntRange(min=1),
              help="Reject longer prompts with 400.")
@click.option("--context-length", default=None, type=click.IntRange(min=1),
              help="Prompt + output tokens a request may reach (default: the model's max_position_embeddings).")
@click.option("--max-tokens", "default_max_tokens", default=None, type=click.IntRange(min=1),
              help="Output tokens of requests that set no limit (default: up to the context's end; "
                   "completions 16, as OpenAI's; the demo model 256, in every API). A request's own "
                   "max_tokens is kept.")
@click.option("--prefill-step-size", "prefill_step", default=PREFILL_STEP, show_default=True,
              type=click.IntRange(min=16),
              help="Prompt tokens prefilled per step: larger chunks prefill long prompts faster, smaller ones "
                   "keep other requests' tokens flowing while a long prompt is read.")
@click.option("--allowed-origins", default=None, callback=lambda ctx, param, value: serve_options.origins(value),
              help="Comma-separated web origins (https://host:port) browsers may call the API from, or '*' "
                   "for any (CORS). Default: none.")
@click.option("--max-body-mb", default=8.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Largest request body in MiB; bigger ones get 413.")
@click.option("--prefix-cache-mb", default=None, type=click.IntRange(min=0),
              help="Memory for reusing the KV/GDN state of shared prompt prefixes (0 = off; default: a "
                   "quarter of the device's memory, at most half of what the model's weights leave).")
@click.option("--prompt-cache-bytes", default=None, callback=lambda ctx, param, value: serve_options.size(value),
              help="The prefix cache's memory as mlx-lm's option gives it: bytes, or with M / MB / G / GB "
                   "(10**6, 10**9 bytes; --prefix-cache-mb counts 2**20). Instead of --prefix-cache-mb.")
@click.option("--prompt-cache-size", "prefix_cache_entries", default=None, type=click.IntRange(min=1),
              help="The most entries the prefix cache keeps, the least recently used leaving first. Default: "
                   "no count, only its memory bounds it (mlx-lm's default is 10): entries are stored at every "
                   "prompt's end, request's end and branch point, so a small count soon evicts the shared "
                   "system prompt's entry that agents reuse.")
@click.option("--prefix-cache-dir", default=None, type=click.Path(file_okay=False),
              help="A folder where the prefix cache keeps the states it evicts from memory and those it holds "
                   "at shutdown; a prompt that starts with one loads it instead of prefilling, also after a "
                   "restart (one subfolder per model, marked as the server's: nothing else in the folder is "
                   "ever deleted or counted, links are never followed). Default: memory only.")
@click.option("--prefix-cache-disk-mb", default=PREFIX_DISK_MB, show_default=True, type=click.IntRange(min=1),
              help="The most MiB of files --prefix-cache-dir holds, the least recently used leaving first; "
                   "it never writes into the disk's last twentieth (at least 2 GiB).")
@click.option("--memory-mb", default=None, type=click.IntRange(min=0),
              help="Memory the caches of running requests and the prefix cache may take together (0 = "
                   "unbounded; default: the device's limit, Metal's recommended working set, less the "
                   "weights and a tenth). New prompts wait and the newest running ones pause to stay "
                   "within it; the context length is capped at what one request can reach in it.")
@click.option("--api-key", default=None, envvar="MLXMTP_API_KEY",
              help="Require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every endpoint but /health "
                   "(also MLXMTP_API_KEY; an empty key is refused).")
@click.option("--alias", "aliases", multiple=True,
              help="Extra model name /v1/models lists and --strict-model-name accepts (repeatable; '*' "
                   "accepts any name).")
@click.option("--strict-model-name", is_flag=True,
              help="Answer only the model's own name and its aliases (others get 404). Default: any "
                   "model name a client sends is answered by the served model, under that name.")
@click.option("--shutdown-timeout", default=10.0, show_default=True, type=click.FloatRange(min=0),
              help="On SIGTERM / Ctrl+C, seconds open streams may run before they are ended with an error "
                   "event; a second signal exits at once.")
@click.option("--dist-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Under mlx.launch: seconds a step may wait on the other ranks; past it the requests in "
                   "flight fail and the server exits non-zero.")
@click.option("--temp", default=None, type=sampling_range("temperature"),
              help="Temperature of requests that set none (default: the model's generation_config.json, else 0).")
@click.option("--top-p", default=None, type=sampling_range("top_p"),
              help="top_p of requests that set none (default: generation_config.json, else 1).")
@click.option("--top-k", default=None, type=sampling_range("top_k", click.IntRange),
              help="top_k of requests that set none (default: generation_config.json, else 0: off).")
@click.option("--min-p", default=None, type=sampling_range("min_p"),
              help="min_p of requests that set none (default: generation_config.json, else 0: off).")
@click.option("--chat-template", default=None, callback=lambda ctx, param, value: serve_options.chat_template(value),
              help="A Jinja chat template, or a file holding one, used instead of the model's own.")
@click.option("--chat-template-args", default=None, callback=lambda ctx, param, value: serve_options.template_args(value),
              help='JSON object of chat template variables for every request, e.g. \'{"enable_thinking": '
                   "false}'. A request's own chat_template_kwargs, thinking or reasoning setting wins.")
@click.option("--suffix-share/--no-suffix-share", default=True, show_default=True,
              help="Let suffix drafts come from finished requests' outputs too (never their prompts; a bounded "
                   "index, its size in /metrics); --no-suffix-share keeps each request to its own prompt and output. "
                   "Drafts change speed only, never the text.")
@click.option("--constrain-tool-calls", is_flag=True,
              help="Hold every tool call the model opens to a grammar, from its <tool_call> token on: one of "
                   "the request's tools, arguments matching that tool's JSON schema, in the model's own call "
                   "syntax (Hermes JSON or Qwen3-Coder XML); text and reasoning outside calls stay free. "
                   "Without it only forced calls (tool_choice required / a named tool) and calls of "
                   "functions marked \"strict\": true are held to their schemas.")
@tokenizer_options
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"], case_sensitive=False))
@click.option("--pipeline", is_flag=True, expose_value=False,
              help="Accepted for mlx_lm.server and ignored: under mlx.launch mlxmtp always splits the model "
                   "across the ranks as a pipeline.")
@click.option("--prompt-concurrency", default=None, type=click.IntRange(min=1), expose_value=False,
              callback=lambda ctx, param, value: value and click.echo(f"Warning: {serve_options.PROMPT_CONCURRENCY_IGNORED}",
                                                                       err=True),
              help="Accepted for mlx_lm.server and ignored: prompts are prefilled one at a time, in chunks.")
@refused_options
def serve(model, host, port, enable_mtp, num_draft, mtp_fallback, max_concurrent, max_prompt_tokens, context_length,
          max_body_mb, prefix_cache_mb, memory_mb, api_key, aliases, strict_model_name, shutdown_timeout, log_level,
          draft_vocab=0, draft_vocab_file=None, pipeline_drafts=False, compile_steps=False,
          dist_timeout=30.0, temp=None, top_p=None, top_k=None, min_p=None, chat_template=None,
          chat_template_args=None, adapter_path=None, default_max_tokens=None, prefill_step=PREFILL_STEP,
          allowed_origins=(), prompt_cache_bytes=None, prefix_cache_entries=None, trust_remote_code=False,
          use_default_chat_template=False, prefix_cache_dir=None, prefix_cache_disk_mb=PREFIX_DISK_MB,
          constrain_tool_calls=False, suffix=True, suffix_share=True, policy_state_dir=POLICY_STATE_DIR):
    """OpenAI- and Anthropic-compatible server.

    Endpoints: /v1/chat/completions, /v1/completions and /v1/responses (OpenAI);
    /v1/messages and /v1/messages/count_tokens (Anthropic); /v1/models (and /v1/models/ID),
    /health and /metrics (Prometheus).

    Under `mlx.launch`, every rank loads its share of the model and rank 0 serves HTTP.
    mlx_lm.server's options are accepted under their names; those mlxmtp cannot honour are refused."""
    serve_options.check_api_key(api_key)  # before the (slow) model load, as the options below
    prefix_cache_mb = serve_options.prefix_cache_mb(prefix_cache_mb, prompt_cache_bytes)
    from ..distributed.group import launched_group  # on use: it loads MLX, which --help never needs

    logging.getLogger("mlxmtp").setLevel(log_level.upper())
    default_max_tokens, demo_default = _output_default(model, default_max_tokens)
    want_mtp, fallback = _mtp_wanted(enable_mtp, num_draft, mtp_fallback)
    group = launched_group()
    serve_options.check_prefix_cache_dir(prefix_cache_dir, prefix_cache_mb, group)
    if group is None or group.rank() == 0:
        serve_options.check_address(host, port)  # before the (slow) model load, as the API key
    engine = _engine_config(want_mtp, num_draft, max_concurrent, prefill_step, prefix_cache_mb, prefix_cache_entries,
                            prefix_cache_dir, prefix_cache_disk_mb, memory_mb, pipeline_drafts, compile_steps, suffix,
                            suffix_share, state_folder(policy_state_dir))
    m, tok = _load(model, group, engine, mtp=want_mtp, mtp_fallback=fallback, draft_vocab=draft_vocab,
                   draft_vocab_file=draft_vocab_file, chat_template=chat_template, adapter_path=adapter_path,
                   trust_remote_code=trust_remote_code, use_default_chat_template=use_default_chat_template)
    make_engine = _engine_factory(group, dist_timeout)  # every rank's engine, from `engine`
    if group is not None and group.rank() > 0:
        return _follow(m, tok, group, make_engine, engine)
    from ..server import app, startup  # on use, as above (and Starlette)

    startup.log_start(model, m, num_draft, host, api_key, default_max_tokens, demo_default)
    _check_changes(tok, adapter_path, chat_template, chat_template_args)
    server = ServerConfig(
        model_id=model or "mlxmtp-demo", aliases=tuple(aliases), strict_model_name=strict_model_name, host=host,
        port=port, shutdown_timeout=shutdown_timeout, log_level=log_level, api_key=api_key, max_body_mb=max_body_mb,
        allowed_origins=allowed_origins, max_prompt_tokens=max_prompt_tokens, context_length=context_length,
        default_max_tokens=default_max_tokens, chat_template_args=chat_template_args,
        sampling_defaults=startup.sampling_defaults(m, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p),
        constrain_tool_calls=constrain_tool_calls)
    _run(app.create_app(m, tok, server, engine, engine_factory=make_engine), host, port, log_level, shutdown_timeout)


def _check_changes(tok, adapter_path, chat_template, chat_template_args) -> None:
    """server.startup.check_changes, its refusal as the command's error."""
    from ..server.startup import check_changes  # on use: it loads MLX, which --help never needs

    try:
        check_changes(tok, adapter_path, chat_template, chat_template_args)
    except ValueError as e:
        raise click.ClickException(str(e)) from e


def _engine_config(enable_mtp: bool, num_draft, max_concurrent: int, prefill_step: int, prefix_cache_mb,
                   prefix_cache_entries, prefix_cache_dir, prefix_cache_disk_mb: int, memory_mb,
                   pipeline_drafts: bool, compile_steps: bool, suffix: bool = True,
                   suffix_share: bool = True, policy_state_dir=None) -> EngineConfig:
    """The engine's config from serve's options (budgets in MiB; None: the machine's
    defaults, engine/budgets.py; `prefix_cache_mb` a fraction of MiB for a budget in bytes,
    --prompt-cache-bytes)."""
    return EngineConfig(
        enable_mtp=enable_mtp, num_draft=num_draft, max_batch=max_concurrent, prefill_step=prefill_step,
        prefix_cache_bytes=None if prefix_cache_mb is None else int(prefix_cache_mb * 2**20),
        prefix_cache_entries=prefix_cache_entries, prefix_cache_dir=prefix_cache_dir,
        prefix_cache_disk_mb=prefix_cache_disk_mb, memory_bytes=None if memory_mb is None else int(memory_mb) * 2**20,
        pipeline_drafts=pipeline_drafts, compile_steps=compile_steps, suffix_drafts=suffix,
        suffix_share=suffix_share, policy_state_dir=policy_state_dir)


def _run(app, host: str, port: int, log_level: str, shutdown_timeout: float) -> None:
    """Serve `app` until a signal ends it (shutdown.run_server)."""
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    from ..server.shutdown import run_server

    if port:  # port 0: the port the system picks, which uvicorn's own start-up line gives
        log.info("serving on http://%s:%d/v1 (OpenAI) and /v1/messages (Anthropic)",
                 f"[{host}]" if ":" in host else host, port)
    run_server(app, host=host, port=port, log_level=log_level.lower(), shutdown_timeout=shutdown_timeout)


def _output_default(model, default_max_tokens):
    """(the output limit of requests that set none, whether it is the demo's default): the
    demo never learnt to end a turn (demo.MAX_TOKENS)."""
    from ..models import demo  # on use, as above

    if default_max_tokens is None and demo.names_demo(model):
        return demo.MAX_TOKENS, True
    return default_max_tokens, False


def _mtp_wanted(enable_mtp, num_draft, mtp_fallback):
    """(whether to load the head, whether a model without one still serves): without an
    explicit --enable-mtp a headless model simply runs without MTP."""
    if enable_mtp is False and num_draft is not None:
        log.warning("--num-draft has no effect with --disable-mtp")
    return enable_mtp is not False, mtp_fallback or enable_mtp is None


def _load(model, group, engine: EngineConfig, **load_options):
    """(model, tokenizer): the whole model, or this rank's share under mlx.launch (every
    rank checked to have rank 0's `engine` config and `load_options`)."""
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    from ..distributed.group import SetupMismatchError
    from ..models.errors import MissingMTPHeadError, ModelLoadError
    from ..models.load import load

    try:
        if group is None:
            return load(model, **load_options)
        from ..distributed.load import load_on_rank  # on use, as above

        m, tok, plan = load_on_rank(group, model, engine, **load_options)
        if group.rank() == 0:
            log.info("distributed: %d ranks, pipeline split, layers per rank %s",
                     group.size(), [r.layers for r in plan.ranks])
        return m, tok
    except MissingMTPHeadError as e:  # only with --enable-mtp: without it a headless model serves
        raise click.ClickException(f"{e} Or serve without MTP: drop --enable-mtp, or add --mtp-fallback.") from e
    except (ModelLoadError, SetupMismatchError) as e:
        raise click.ClickException(str(e)) from e


def _engine_factory(group, dist_timeout: float):
    """What builds every rank's engine, `factory(model, tok, engine_config)`: the engine
    alone (engine/build.py), or under mlx.launch a DistributedEngine driving the engine it
    builds the same way with its rank's coordinator (its failure ends the server:
    EngineBridge.fail_and_exit)."""
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    from ..engine.build import build_engine

    if group is None:
        return build_engine
    from ..distributed.engine import DistributedEngine  # on use, as above

    return functools.partial(DistributedEngine, group=group, dist_timeout=dist_timeout)


def _follow(m, tok, group, make_engine, engine: EngineConfig) -> None:
    """Ranks > 0 of a distributed server: run rank 0's steps on the engine built as rank
    0's is (`make_engine`, the same `engine` config) until it stops, then exit."""
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    from ..mlxlm.family import text_parts
    from ..server.structured_output import serve_tokenizer

    serve_tokenizer(tok, text_parts(m).args.vocab_size)  # rank 0's response formats run here too
    log.info("rank %d: following rank 0", group.rank())
    make_engine(m, tok, engine).follow()
