"""`mlxmtp serve`: load a model (the packaged demo model by default) and serve it."""

from __future__ import annotations

import functools
import json
import logging
import os
import socket

import click

from ..engine.cli_options import ADAPTER_PATH, drafting_options, refused_options, tokenizer_options
from ..engine.limits import PREFILL_STEP, PREFIX_DISK_MB

log = logging.getLogger("mlxmtp.server")

# mlx_lm.server's --prompt-concurrency, taken and ignored (its users pass it with their
# other options), with a warning saying why.
PROMPT_CONCURRENCY_IGNORED = ("--prompt-concurrency is ignored: mlxmtp prefills one prompt at a time, in "
                              "--prefill-step-size chunks between decode cycles, so there is no prompt batch to size "
                              "(--max-concurrent / --decode-concurrency bounds the requests decoded together)")


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
@click.option("--allowed-origins", default=None, callback=lambda ctx, param, value: _origins(value),
              help="Comma-separated web origins (https://host:port) browsers may call the API from, or '*' "
                   "for any (CORS). Default: none.")
@click.option("--max-body-mb", default=8.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Largest request body in MiB; bigger ones get 413.")
@click.option("--prefix-cache-mb", default=None, type=click.IntRange(min=0),
              help="Memory for reusing the KV/GDN state of shared prompt prefixes (0 = off; default: a "
                   "quarter of the device's memory, at most half of what the model's weights leave).")
@click.option("--prompt-cache-bytes", default=None, callback=lambda ctx, param, value: _size(value),
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
@click.option("--temp", default=None, type=click.FloatRange(min=0),
              help="Temperature of requests that set none (default: the model's generation_config.json, else 0).")
@click.option("--top-p", default=None, type=click.FloatRange(0, 1, min_open=True),
              help="top_p of requests that set none (default: generation_config.json, else 1).")
@click.option("--top-k", default=None, type=click.IntRange(min=0),
              help="top_k of requests that set none (default: generation_config.json, else 0: off).")
@click.option("--min-p", default=None, type=click.FloatRange(0, 1),
              help="min_p of requests that set none (default: generation_config.json, else 0: off).")
@click.option("--chat-template", default=None, callback=lambda ctx, param, value: _chat_template(value),
              help="A Jinja chat template, or a file holding one, used instead of the model's own.")
@click.option("--chat-template-args", default=None, callback=lambda ctx, param, value: _template_args(value),
              help='JSON object of chat template variables for every request, e.g. \'{"enable_thinking": '
                   "false}'. A request's own chat_template_kwargs, thinking or reasoning setting wins.")
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
              callback=lambda ctx, param, value: value and click.echo(f"Warning: {PROMPT_CONCURRENCY_IGNORED}",
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
          constrain_tool_calls=False):
    """OpenAI- and Anthropic-compatible server.

    Endpoints: /v1/chat/completions, /v1/completions and /v1/responses (OpenAI);
    /v1/messages and /v1/messages/count_tokens (Anthropic); /v1/models (and /v1/models/ID),
    /health and /metrics (Prometheus).

    Under `mlx.launch`, every rank loads its share of the model and rank 0 serves HTTP.
    mlx_lm.server's options are accepted under their names; those mlxmtp cannot honour are refused."""
    _check_api_key(api_key)  # before the (slow) model load, as the options below
    prefix_cache_mb = _prefix_cache_mb(prefix_cache_mb, prompt_cache_bytes)
    from ..distributed.group import launched_group  # on use: it loads MLX, which --help never needs

    logging.getLogger("mlxmtp").setLevel(log_level.upper())
    default_max_tokens, demo_default = _output_default(model, default_max_tokens)
    want_mtp, fallback = _mtp_wanted(enable_mtp, num_draft, mtp_fallback)
    group = launched_group()
    _check_prefix_cache_dir(prefix_cache_dir, prefix_cache_mb, group)
    if group is None or group.rank() == 0:
        _check_address(host, port)  # before the (slow) model load, as the API key
    # The engine's settings: every rank must be started with the same (distributed/group.py).
    settings = dict(num_draft=num_draft, max_concurrent=max_concurrent, prefix_cache_mb=prefix_cache_mb,
                    prefix_cache_entries=prefix_cache_entries, pipeline_drafts=pipeline_drafts,
                    compile_steps=compile_steps, prefill_step=prefill_step)
    m, tok = _load(model, group, settings, mtp=want_mtp, mtp_fallback=fallback, draft_vocab=draft_vocab,
                   draft_vocab_file=draft_vocab_file, chat_template=chat_template, adapter_path=adapter_path,
                   trust_remote_code=trust_remote_code, use_default_chat_template=use_default_chat_template)
    if group is not None and group.rank() > 0:
        return _follow(m, tok, group, dist_timeout, want_mtp, memory_mb, settings)
    _log_start(model, m, num_draft, host, api_key, default_max_tokens, demo_default)
    _check_changes(tok, adapter_path, chat_template, chat_template_args)
    from .app import create_app  # on use: it loads MLX (seconds), which --help never needs

    app = create_app(m, tok, model_id=model or "mlxmtp-demo", enable_mtp=want_mtp, **settings,
                     engine_factory=_engine_factory(group, dist_timeout),
                     max_prompt_tokens=max_prompt_tokens, memory_mb=memory_mb, api_key=api_key,
                     aliases=aliases, context_length=context_length, max_body_mb=max_body_mb,
                     strict_model_name=strict_model_name, chat_template_args=chat_template_args,
                     default_max_tokens=default_max_tokens, allowed_origins=allowed_origins,
                     prefix_cache_dir=prefix_cache_dir, prefix_cache_disk_mb=prefix_cache_disk_mb,
                     constrain_tool_calls=constrain_tool_calls,
                     sampling_defaults=_sampling_defaults(m, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p))
    _run(app, host, port, log_level, shutdown_timeout)


def _run(app, host: str, port: int, log_level: str, shutdown_timeout: float) -> None:
    """Serve `app` until a signal ends it (shutdown.run_server)."""
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    from .shutdown import run_server

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


def _log_start(model, m, num_draft, host: str, api_key, default_max_tokens, demo_default: bool) -> None:
    """What is served, how, the output limit of requests that set none, and a warning when
    anyone on the network could use it."""
    from ..models import demo  # on use, as above

    log.info("model: %s", f"packaged demo model ({demo.NAME})" if demo.names_demo(model) else model)
    if m.active:
        log.info("MTP head: active (%s, %d layer(s)); draft depth %s", m.source.location if m.source else "?",
                 max(1, m.info.get("num_layers", 1)), num_draft if num_draft is not None else "adaptive")
    else:
        log.info("MTP head: inactive (%s)", m.disabled_reason or "not requested")
    _log_output_limit(default_max_tokens, demo_default)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("binding %s without --api-key: anyone who can reach it can use the model", host)


def _log_output_limit(default_max_tokens, demo_default: bool) -> None:
    """What a request that sets no output limit gets."""
    if demo_default:
        log.info("output of a request that sets no max_tokens: up to %d tokens, the demo model's default "
                 "(--max-tokens N sets another)", default_max_tokens)
    elif default_max_tokens is not None:
        log.info("output of a request that sets no max_tokens: up to %d tokens (--max-tokens)", default_max_tokens)
    else:
        log.info("output of a request that sets no max_tokens: to the end of its turn or of the context "
                 "(completions: 16; --max-tokens N caps it)")


def _check_changes(tok, adapter_path, chat_template, chat_template_args) -> None:
    """Log what the options change of the model as its folder has it, and refuse a chat
    template that cannot render a one-message conversation now, not at the first request."""
    if adapter_path is not None:
        log.info("adapters: %s", adapter_path)
    if chat_template is None and not chat_template_args:
        return
    if getattr(tok, "chat_template", None) is not None:
        try:
            text = tok.apply_chat_template([{"role": "user", "content": "a user's words"}], tokenize=False,
                                           add_generation_prompt=True, **chat_template_args)
        except Exception as e:  # noqa: BLE001 - Jinja's syntax and runtime errors alike
            raise click.ClickException(f"the chat template cannot render a conversation: {e}") from e
        if "a user's words" not in text:
            raise click.ClickException("the chat template leaves a conversation's messages out of the prompt")
    log.info("chat template: %s; variables for every request: %s",
             "--chat-template" if chat_template is not None else "the model's", chat_template_args or "none")


def _sampling_defaults(m, **options) -> dict:
    """What a request that leaves a sampling field unset gets: the option given, else the
    model's generation_config.json (models/generation_config.py), else greedy decoding."""
    from ..models.generation_config import recommended_sampling  # on use, as above

    recommended = recommended_sampling(getattr(m, "model_dir", None))
    defaults = {**recommended, **{k: v for k, v in options.items() if v is not None}}
    log.info("sampling fields a request leaves unset: %s",
             ", ".join(f"{k} {v}" for k, v in defaults.items()) or "greedy decoding")
    return defaults


def _chat_template(value):
    """--chat-template: a file's text, or the template itself. A value that is neither an
    existing file nor Jinja (a mistyped path) is refused rather than served as a prompt."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise click.BadParameter(f"cannot read {value}: {e}", param_hint="--chat-template") from None
    if "{{" in value or "{%" in value:
        return value
    raise click.BadParameter(f"{value!r} is neither a file nor a Jinja template", param_hint="--chat-template")


def _size(value):
    """--prompt-cache-bytes: bytes, read as mlx-lm reads its sizes."""
    if value is None:
        return None
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    from ..mlxlm.loading import parse_size

    try:
        return parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--prompt-cache-bytes") from None


def _check_prefix_cache_dir(folder, prefix_cache_mb, group) -> None:
    """Refuse a prefix cache folder that cannot serve (before the model load)."""
    if not folder:
        return
    if group is not None:
        raise click.UsageError("--prefix-cache-dir is not supported under mlx.launch: every rank would load "
                               "and evict states on its own")
    if prefix_cache_mb == 0:
        raise click.UsageError("--prefix-cache-dir keeps what the prefix cache evicts from memory: it needs "
                               "--prefix-cache-mb above 0")
    try:
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"no permission to write in {folder}")
    except OSError as e:
        raise click.UsageError(f"--prefix-cache-dir {folder}: {e}") from e


def _prefix_cache_mb(prefix_cache_mb, prompt_cache_bytes):
    """The prefix cache's budget in MiB (None: the default): --prefix-cache-mb's, or mlx-lm's
    --prompt-cache-bytes as a fraction of MiB (exact: bytes / 2**20 * 2**20 gives them back)."""
    if prompt_cache_bytes is None:
        return prefix_cache_mb
    if prefix_cache_mb is not None:
        raise click.UsageError("--prompt-cache-bytes and --prefix-cache-mb both set the prefix cache's memory: "
                               "give one of them")
    return prompt_cache_bytes / 2**20


def _origins(value) -> tuple:
    """--allowed-origins: '*' or origins as browsers send them (scheme://host[:port], no
    path), which CORS compares exactly: 'http://localhost:3000/' would never match."""
    if value is None:
        return ()
    origins = tuple(o.strip() for o in value.split(",") if o.strip())
    for o in origins:
        scheme, sep, rest = o.partition("://")
        if o != "*" and (not sep or scheme not in ("http", "https") or not rest or "/" in rest):
            raise click.BadParameter(f"{o!r} is not an origin: give scheme://host[:port] with no path, "
                                     "or '*'", param_hint="--allowed-origins")
    return origins


def _template_args(value):
    """--chat-template-args: a JSON object of the template's variables (not its rendering
    arguments, which the server sets per request)."""
    from .chat import RENDERING_ARGUMENTS  # on use: the server's modules load Starlette

    if value is None:
        return {}
    try:
        args = json.loads(value)
    except ValueError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint="--chat-template-args") from None
    if not isinstance(args, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--chat-template-args")
    refused = sorted(RENDERING_ARGUMENTS & set(args))
    if refused:
        raise click.BadParameter(f"{', '.join(refused)}: set by the server per request, not a template variable "
                                 "(use --chat-template for the template itself)", param_hint="--chat-template-args")
    if not isinstance(args.get("enable_thinking", False), bool):
        raise click.BadParameter("enable_thinking must be true or false", param_hint="--chat-template-args")
    return args


def _load(model, group, settings: dict, **load_options):
    """(model, tokenizer): the whole model, or this rank's share under mlx.launch."""
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    from ..distributed.group import SetupMismatchError
    from ..models.load import MissingMTPHeadError, ModelLoadError, load

    try:
        if group is None:
            return load(model, **load_options)
        from ..distributed.load import load_on_rank  # on use, as above

        m, tok, plan = load_on_rank(group, model, {**settings, **load_options}, **load_options)
        if group.rank() == 0:
            log.info("distributed: %d ranks, pipeline split, layers per rank %s",
                     group.size(), [r.layers for r in plan.ranks])
        return m, tok
    except MissingMTPHeadError as e:  # only with --enable-mtp: without it a headless model serves
        raise click.ClickException(f"{e} Or serve without MTP: drop --enable-mtp, or add --mtp-fallback.") from e
    except (ModelLoadError, SetupMismatchError) as e:
        raise click.ClickException(str(e)) from e


def _engine_factory(group, dist_timeout: float):
    """What builds rank 0's engine: the plain engine alone, a DistributedEngine under
    mlx.launch (whose failure ends the server: EngineBridge.fail_and_exit)."""
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    from ..engine.batch import BatchGenerator

    if group is None:
        return BatchGenerator
    from ..distributed.engine import DistributedEngine  # on use, as above

    return functools.partial(DistributedEngine, group=group, dist_timeout=dist_timeout)


def _follow(m, tok, group, dist_timeout: float, mtp: bool, memory_mb, settings: dict) -> None:
    """Ranks > 0 of a distributed server: run rank 0's steps (engine options built from the
    `settings` every rank shares, as create_app builds rank 0's) until it stops, then exit."""
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    from ..distributed.engine import DistributedEngine
    from ..mlxlm.family import text_parts
    from .app import engine_options
    from .structured_output import serve_tokenizer

    serve_tokenizer(tok, text_parts(m).args.vocab_size)  # rank 0's response formats run here too
    log.info("rank %d: following rank 0", group.rank())
    options = engine_options(m, mtp, memory_mb=memory_mb, **settings)
    DistributedEngine(m, tok, group=group, dist_timeout=dist_timeout, **options).follow()


def _check_address(host: str, port: int) -> None:
    """Refuse an address serving could not listen on (another server has the port), now
    rather than after minutes of loading a large model."""
    if port == 0:  # any free port
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind(address)
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _check_api_key(api_key):
    """An empty key must not silently mean "no authentication": create_app treats a falsy
    key as off, and click treats an empty environment variable as unset."""
    env = os.environ.get("MLXMTP_API_KEY")
    if api_key is not None and not api_key.strip():
        src = click.get_current_context().get_parameter_source("api_key")
        where = "MLXMTP_API_KEY" if src == click.core.ParameterSource.ENVIRONMENT else "--api-key"
        raise click.BadParameter("the API key is empty; give a real key, or leave the option out to serve "
                                 "without authentication", param_hint=where)
    if api_key is None and env is not None:  # set but empty: click passed None
        raise click.BadParameter("the API key is empty; give a real key, or unset the variable to serve "
                                 "without authentication", param_hint="MLXMTP_API_KEY")
