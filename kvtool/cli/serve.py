"""``kvtool serve``: the hot/cold scheduling API over a store, for the process that knows the future."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

import typer

from kvtool.cli._common import Command, setup_logging
from kvtool.errors import UnavailableError, UsageError
from kvtool.server.auth import DEFAULT_LISTEN, TOKEN_ENV, default_token_file, load_token
from kvtool.store import as_stack, open_store

DEFAULT_MEMORY_TIER = "memory://?capacity=1GiB"


def serve(
    store: Optional[str] = typer.Option(
        None, "--store", "-s", envvar="KVTOOL_STORE", show_default=False,
        help="Store URL, or comma-separated URLs fastest tier first. Default: 1 GiB of memory over the file "
        "store of `kvtool store` ($XDG_CACHE_HOME/kvtool/store).",
    ),
    listen: str = typer.Option(
        DEFAULT_LISTEN, "--listen", "-l", envvar="KVTOOL_API_LISTEN",
        help="unix:///PATH (a socket only you can use) or HOST:PORT. A host that is not loopback needs --allow-remote.",
    ),
    allow_remote: bool = typer.Option(False, "--allow-remote", help="Allow a non-loopback --listen address."),
    token_file: Optional[Path] = typer.Option(
        None, "--token-file", show_default=False,
        help=f"File holding the bearer token, created (mode 600) if missing; ${TOKEN_ENV} overrides it. "
        "Default: $XDG_CONFIG_HOME/kvtool/api-token (~/.config/kvtool/api-token).",
    ),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help="Serve HTTPS with this certificate (PEM)."),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key", help="The certificate's private key (PEM)."),
    rate: float = typer.Option(1000.0, "--rate", min=0, help="Requests a second allowed per client; 0: no limit."),
    burst: int = typer.Option(2000, "--burst", min=1, help="Requests a client may send at once above --rate."),
    max_body: int = typer.Option(8 << 20, "--max-body", min=1024, help="Largest JSON request body, in bytes."),
    max_value: int = typer.Option(256 << 20, "--max-value", min=1024, help="Largest entry value a PUT may send, in bytes."),
    lookup_defaults: Optional[str] = typer.Option(
        None, "--lookup-defaults",
        help='JSON object of lookup fields clients may leave out, e.g. \'{"model": "org/model", "salt": ""}\'.',
    ),
    log_level: Optional[str] = typer.Option(
        None, "--log-level", show_default=False,
        help="uvicorn and kvtool log level: debug, info, warning, error. Default: warning, or as the global -v/-q say.",
    ),
):
    """Serve the hot/cold scheduling API (pin, prefetch, offload, evict, hint, lookup, events, metrics) over a store.

    Every call but /v1/health, /metrics and /openapi.json needs the bearer token. Stops on Ctrl-C
    or SIGTERM; entries in memory then move to the store's persistent tier. docs/API.md has the details.
    """
    try:
        from kvtool.server.context import Limits
        from kvtool.server.lookup import PrefixQuery
        from kvtool.server.run import ApiServer
    except ImportError as exc:
        raise UnavailableError(f"kvtool serve needs the api extra ({exc.name} is missing): pip install 'kvtool[api]'") from None
    from kvtool.cli.store import default_store_url

    defaults = _parse_defaults(lookup_defaults, set(PrefixQuery.__dataclass_fields__) - {"tokens"})
    level = log_level.upper() if log_level else logging.getLevelName(logging.getLogger("kvtool").getEffectiveLevel())
    if not isinstance(logging.getLevelName(level), int):
        raise UsageError(f"--log-level {log_level!r}: write debug, info, warning or error")
    setup_logging(level, "uvicorn")
    token = load_token(token_file, create=True)
    url = store or f"{DEFAULT_MEMORY_TIER},{default_store_url()}"
    tiered = as_stack(open_store(url))
    try:
        limits = Limits(max_json_bytes=max_body, max_value_bytes=max_value, rate=rate, burst=burst)
        server = ApiServer(tiered, token, listen, allow_remote=allow_remote, tls_cert=tls_cert, tls_key=tls_key,
                           limits=limits, lookup_defaults=defaults, log_level=level.lower())
        where = "$" + TOKEN_ENV if TOKEN_ENV in os.environ else (token_file or default_token_file())
        typer.echo(f"kvtool API on {server.url} over {tiered.describe()} (bearer token: {where})", err=True)
        server.run()
    finally:
        tiered.close()


def _parse_defaults(text: str | None, known: set[str]) -> dict:
    if text is None:
        return {}
    try:
        defaults = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--lookup-defaults is not JSON: {exc}") from None
    if not isinstance(defaults, dict) or set(defaults) - known:
        raise UsageError(f"--lookup-defaults must be a JSON object with fields among: {', '.join(sorted(known))}")
    return defaults


def register(app: typer.Typer) -> None:
    app.command("serve", cls=Command)(serve)
