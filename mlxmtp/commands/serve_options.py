"""`mlxmtp serve`'s option values read and checked: each option's own parsing (click
callbacks), and the checks that refuse a command line before the model loads (minutes, for
a large model)."""

from __future__ import annotations

import json
import os
import socket

import click

# mlx_lm.server's --prompt-concurrency, taken and ignored (its users pass it with their
# other options), with a warning saying why.
PROMPT_CONCURRENCY_IGNORED = ("--prompt-concurrency is ignored: mlxmtp prefills one prompt at a time, in "
                              "--prefill-step-size chunks between decode cycles, so there is no prompt batch to size "
                              "(--max-concurrent / --decode-concurrency bounds the requests decoded together)")


# ------------------------------------------------------------------ option values (click callbacks)
def chat_template(value):
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


def size(value):
    """--prompt-cache-bytes: bytes, read as mlx-lm reads its sizes."""
    if value is None:
        return None
    # On use: importing it loads MLX (seconds), which `mlxmtp --help` and start-up never need.
    from ..mlxlm.loading import parse_size

    try:
        return parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--prompt-cache-bytes") from None


def origins(value) -> tuple:
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


def template_args(value):
    """--chat-template-args: a JSON object of the template's variables (not its rendering
    arguments, which the server sets per request)."""
    from ..server.chat import RENDERING_ARGUMENTS  # on use: the server's modules load Starlette

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


# ------------------------------------------------------------------ before the model loads
def check_api_key(api_key):
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


def prefix_cache_mb(prefix_cache_mb, prompt_cache_bytes):
    """The prefix cache's budget in MiB (None: the default): --prefix-cache-mb's, or mlx-lm's
    --prompt-cache-bytes as a fraction of MiB (exact: bytes / 2**20 * 2**20 gives them back)."""
    if prompt_cache_bytes is None:
        return prefix_cache_mb
    if prefix_cache_mb is not None:
        raise click.UsageError("--prompt-cache-bytes and --prefix-cache-mb both set the prefix cache's memory: "
                               "give one of them")
    return prompt_cache_bytes / 2**20


def check_prefix_cache_dir(folder, prefix_cache_mb, group) -> None:
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


def check_address(host: str, port: int) -> None:
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
