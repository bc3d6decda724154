"""``kvtool store``: put, get, list, inspect, evict and schedule the entries of a KV cache store.

Every command acts on a target (``kvtool.cli.store_target``): the store ``--store`` names,
opened by the command, or with ``--api URL`` a running server's (``kvtool serve``, or vLLM
with the API on). Pin, unpin, prefetch, offload, hint and events need the server.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import typer

from kvtool.cli._common import JSON_OPTION, Command, Group, existing_file, print_json, print_result, print_table
from kvtool.cli.store_target import ApiTarget, Target, default_store_url, open_target
from kvtool.errors import KvtoolError, UsageError
from kvtool.fileio import atomic_write
from kvtool.units import format_size

__all__ = ["default_store_url", "store_app"]

log = logging.getLogger("kvtool.cli.store")

store_app = typer.Typer(
    cls=Group,
    name="store",
    help="Put, get, list and evict entries of a KV cache store (memory, file, redis, or tiers of them), "
    "or of a running API server's store with --api.",
    no_args_is_help=True,
)

STORE_ENV, API_ENV = "KVTOOL_STORE", "KVTOOL_API"
STORE_OPTION = typer.Option(
    None,
    "--store",
    "-s",
    show_default=False,
    help="Store URL, or comma-separated URLs fastest tier first: memory://?capacity=2GiB, "
    "file:///path?capacity=100GiB, redis://host:6379/0?ttl=3600, redis+cluster://host:7000,host2:7000/?ttl=3600. "
    "Default: $KVTOOL_STORE, else a file store in $XDG_CACHE_HOME/kvtool/store (~/.cache/kvtool/store). "
    "Only `put` creates a store; every other command needs one that exists.",
)
#: --api of the commands that act on a store or a server (``--api`` or --store on the command line win
#: over $KVTOOL_API, which wins over $KVTOOL_STORE).
TARGET_API_OPTION = typer.Option(
    None, "--api", show_default=False,
    help="Act on the store of a kvtool API server instead of --store: http://127.0.0.1:8470 "
    "(the default of `kvtool serve`) or unix:///PATH. Default: $KVTOOL_API when no --store is given.",
)
#: --api of the commands only a server has.
API_OPTION = typer.Option(
    None, "--api", envvar=API_ENV, show_default=False,
    help="URL of the kvtool API server: http://127.0.0.1:8470 (the default of `kvtool serve`) or unix:///PATH.",
)
TOKEN_FILE_OPTION = typer.Option(
    None, "--token-file", show_default=False,
    help="File holding the API's bearer token ($KVTOOL_API_TOKEN overrides it; default ~/.config/kvtool/api-token).",
)


@contextmanager
def _server(api: Optional[str], token_file: Optional[Path]) -> Iterator[ApiTarget]:
    """A running API server, for the verbs only a server has."""
    target = ApiTarget(api, token_file)
    try:
        yield target
    finally:
        target.close()


def _chosen(store: Optional[str], api: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(store, api) to act on: an option on the command line wins over a variable, ``--api`` over
    ``--store``, and ``KVTOOL_API`` over ``KVTOOL_STORE`` (a server was asked for by name)."""
    if api or store:
        return (None, api) if api else (store, None)
    if os.environ.get(API_ENV):
        return None, os.environ[API_ENV]
    return os.environ.get(STORE_ENV) or None, None


@contextmanager
def _target(store: Optional[str], api: Optional[str], token_file: Optional[Path], **mode: bool) -> Iterator[Target]:
    chosen_store, chosen_api = _chosen(store, api)
    target = open_target(chosen_store, chosen_api, token_file, **mode)
    try:
        yield target
    finally:
        target.close()


@store_app.command("put", cls=Command)
def put(
    key: str = typer.Argument(..., help="Key to store the value under."),
    source: str = typer.Argument(..., help="File to store, or - for standard input."),
    store: Optional[str] = STORE_OPTION,
    tokens: Optional[int] = typer.Option(
        None, "--tokens", min=0, show_default=False,
        help="Tokens of KV cache the value holds (kept as metadata). Default: read from a .kvz value's header.",
    ),
    api: Optional[str] = TARGET_API_OPTION,
    token_file: Optional[Path] = TOKEN_FILE_OPTION,
    json_out: bool = JSON_OPTION,
):
    """Store a file (or standard input) under KEY (creating the store if there is none)."""
    import kvtool.kvz  # noqa: F401 - imported before the clock starts: the time reported is the command's work
    from kvtool.dtypes import register_numpy_types

    register_numpy_types()
    started = time.perf_counter()
    log.info("reading %s", "standard input" if source == "-" else source)
    data = typer.get_binary_stream("stdin").read() if source == "-" else existing_file(Path(source)).read_bytes()
    if tokens is None:
        tokens = kvz_tokens(data)
        log.info("the value holds %s", "no .kvz header" if tokens is None else f"a .kvz of {tokens} tokens")
    with _target(store, api, token_file, writes=True) as target:
        target.put(key, data, tokens)
        where = target.describe()
    seconds = time.perf_counter() - started
    held = "" if tokens is None else f", {tokens} tokens"
    print_result({"key": key, "bytes": len(data), "tokens": tokens, "store": where, "seconds": round(seconds, 3)},
                 f"stored {key!r} in {where}: {format_size(len(data))}{held} in {seconds:.2f} s", json_out)


def kvz_tokens(value: bytes) -> int | None:
    """The token count in a .kvz value's header, or None for any other value (or a damaged .kvz)."""
    from kvtool import kvz

    if not value.startswith(kvz.MAGIC):
        return None
    try:
        with kvz.KvzReader.from_bytes(value) as reader:
            return reader.num_tokens
    except KvtoolError:
        return None


@store_app.command("get", cls=Command)
def get(
    key: str = typer.Argument(..., help="Key to read."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the value here instead of standard output."),
    store: Optional[str] = STORE_OPTION,
    api: Optional[str] = TARGET_API_OPTION,
    token_file: Optional[Path] = TOKEN_FILE_OPTION,
):
    """Write the value stored under KEY to standard output or a file; exit 1 if there is none."""
    with _target(store, api, token_file) as target:
        value = target.get(key)
        if value is None:
            raise KvtoolError(f"no entry {key!r} in {target.describe()}")
        where = target.describe()
    if output is None:
        out = typer.get_binary_stream("stdout")
        out.write(value)
        out.flush()
    else:
        with atomic_write(output) as f:
            f.write(value)
        print_result({}, f"wrote {key!r} from {where} to {output}: {format_size(len(value))}", False)


@store_app.command("ls", cls=Command)
def ls(store: Optional[str] = STORE_OPTION, api: Optional[str] = TARGET_API_OPTION,
       token_file: Optional[Path] = TOKEN_FILE_OPTION, json_out: bool = JSON_OPTION):
    """List the entries: key, tier, stored size and token count (reads only: changes nothing)."""
    with _target(store, api, token_file, reads_only=True) as target:
        rows = target.entries()
        where = target.describe()
    if json_out:
        print_json(rows)
        return
    if rows:
        print_table([{**r, "size": format_size(r["bytes"])} for r in rows], ["key", "tier", "size", "tokens"])
    total = sum(r["bytes"] for r in rows)
    typer.echo(f"{len(rows)} {'entry' if len(rows) == 1 else 'entries'} in {where}"
               + (f", {format_size(total)}" if rows else ""))


@store_app.command("stats", cls=Command)
def stats(
    store: Optional[str] = STORE_OPTION,
    json_out: bool = JSON_OPTION,
    prometheus: bool = typer.Option(
        False, "--prometheus", help="Print Prometheus text exposition format (needs the metrics extra)."
    ),
    api: Optional[str] = TARGET_API_OPTION,
    token_file: Optional[Path] = TOKEN_FILE_OPTION,
):
    """What the store holds, per tier: entries, bytes, capacity, writes its servers refused for lack of memory
    (Redis, from every client). Reads only: changes nothing.

    --json and --prometheus add this process's counters (hits, bytes read, ...),
    which start at zero: a store's activity is in the metrics of the processes using it.
    """
    with _target(store, api, token_file, reads_only=True) as target:
        data = target.stats()
    if json_out:
        print_json(data)
        return
    if prometheus:
        from kvtool.store.metrics import prometheus_text

        try:
            text = prometheus_text(data)
        except ImportError:
            raise UsageError("--prometheus needs prometheus_client: pip install 'kvtool[metrics]'") from None
        typer.echo(text.decode(), nl=False)
        return
    rows = []
    for tier in data.get("tiers", [data]):
        capacity = tier["capacity_bytes"]
        used = tier["used_bytes"]
        rows.append({
            "tier": tier.get("tier", tier["name"]),
            "store": tier["store"],
            "entries": tier["entries"],
            "used": "?" if used is None else format_size(used),
            "capacity": "unbounded" if capacity is None else format_size(capacity),
            # what the tier's servers refused for lack of memory, from every client (Redis), where they say
            "refused writes": tier.get("server_refused_writes", "-"),
        })
    print_table(rows, ["tier", "store", "entries", "used", "capacity", "refused writes"])


KEYS_ARGUMENT = typer.Argument(..., help="Keys of the entries.", show_default=False)


def _report(answer: dict[str, Any], json_out: bool) -> None:
    """Print a per-key verb's answer, and fail if a key was not done."""
    results = answer["results"]
    if json_out:
        print_json(answer)
    elif len(results) > 1 or any(r["tier"] for r in results):
        print_table([{**r, "tier": r["tier"] or "-"} for r in results], ["key", "status", "tier"])
    failed = [r for r in results if not r["ok"]]
    if failed:
        listed = ", ".join(f"{r['key'][:40]} ({r['status']})" for r in failed[:5])
        raise KvtoolError(f"{len(failed)} of {len(results)} keys not done: {listed}")


@store_app.command("evict", cls=Command)
def evict(
    keys: list[str] = typer.Argument(..., help="Keys to remove."),
    store: Optional[str] = STORE_OPTION,
    api: Optional[str] = TARGET_API_OPTION,
    token_file: Optional[Path] = TOKEN_FILE_OPTION,
    json_out: bool = JSON_OPTION,
):
    """Remove KEYS from every tier (of a store, or of a server with --api); exit 1 if one was not there."""
    with _target(store, api, token_file) as target:
        answer = target.evict(keys)
        where = target.describe()
    (first, *more) = answer["results"]
    if not more and first["status"] == "missing" and not json_out:
        raise KvtoolError(f"no entry {first['key']!r} in {where}")
    _report(answer, json_out)


@store_app.command("pin", cls=Command)
def pin(keys: list[str] = KEYS_ARGUMENT, api: Optional[str] = API_OPTION,
        token_file: Optional[Path] = TOKEN_FILE_OPTION, json_out: bool = JSON_OPTION):
    """Keep entries where they are until unpinned (never demoted or evicted), through the API."""
    with _server(api, token_file) as target:
        _report(target.pin(keys), json_out)


@store_app.command("unpin", cls=Command)
def unpin(keys: list[str] = KEYS_ARGUMENT, api: Optional[str] = API_OPTION,
          token_file: Optional[Path] = TOKEN_FILE_OPTION, json_out: bool = JSON_OPTION):
    """Let pinned entries move and leave again, through the API."""
    with _server(api, token_file) as target:
        _report(target.unpin(keys), json_out)


@store_app.command("prefetch", cls=Command)
def prefetch(
    keys: list[str] = KEYS_ARGUMENT,
    wait: bool = typer.Option(False, "--wait", help="Return when the entries are in the fastest tier."),
    api: Optional[str] = API_OPTION, token_file: Optional[Path] = TOKEN_FILE_OPTION, json_out: bool = JSON_OPTION,
):
    """Bring entries to the fastest tier ahead of the request that needs them, through the API."""
    with _server(api, token_file) as target:
        _report(target.prefetch(keys, wait=wait), json_out)


@store_app.command("offload", cls=Command)
def offload(
    keys: list[str] = KEYS_ARGUMENT,
    to: str = typer.Option("-1", "--to", help="Tier name or number (0 the fastest, -1 the slowest)."),
    api: Optional[str] = API_OPTION, token_file: Optional[Path] = TOKEN_FILE_OPTION, json_out: bool = JSON_OPTION,
):
    """Move entries down now (a session pauses), through the API."""
    target = int(to) if to.lstrip("-").isdigit() else to
    with _server(api, token_file) as on:
        _report(on.offload(keys, to=target), json_out)


@store_app.command("hint", cls=Command)
def hint(
    keys: list[str] = KEYS_ARGUMENT,
    returns_in: float = typer.Option(..., "--returns-in", min=0, help="Seconds until the entries are needed, not before."),
    offload_now: bool = typer.Option(False, "--offload", help="Move them to the slowest tier now."),
    prefetch_ahead: Optional[float] = typer.Option(
        None, "--prefetch-ahead", min=0, help="Prefetch them this many seconds before they are due."
    ),
    api: Optional[str] = API_OPTION, token_file: Optional[Path] = TOKEN_FILE_OPTION, json_out: bool = JSON_OPTION,
):
    """Tell the placement policy when entries are needed again (an agent's tool call returns), through the API."""
    with _server(api, token_file) as target:
        _report(target.hint(keys, returns_in_s=returns_in, offload=offload_now, prefetch_ahead_s=prefetch_ahead),
                json_out)


@store_app.command("lookup", cls=Command)
def lookup(
    tokens: Optional[str] = typer.Option(None, "--tokens", help="Token ids, comma or space separated."),
    tokens_file: Optional[Path] = typer.Option(
        None, "--tokens-file", help="File (or - for standard input) of token ids: a JSON array, or separated by commas or spaces."
    ),
    model: Optional[str] = typer.Option(None, "--model", help="Model id the entries were keyed with."),
    salt: Optional[str] = typer.Option(None, "--salt", help="Tenant salt (vLLM: the request's cache_salt)."),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="Recipe the entries were keyed with."),
    chunk_tokens: Optional[int] = typer.Option(None, "--chunk-tokens", min=1, help="Tokens per entry."),
    scheme: Optional[str] = typer.Option(None, "--scheme", help="Key scheme: prefix (kvtool's prefix keys) or vllm."),
    block_size: Optional[int] = typer.Option(None, "--block-size", min=1, help="vllm: vLLM's block size."),
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="vllm: the KV dtype, as torch.bfloat16."),
    tp_size: Optional[int] = typer.Option(None, "--tp-size", min=1, help="vllm: tensor-parallel size."),
    hash_algo: Optional[str] = typer.Option(None, "--hash-algo", help="vllm: prefix_caching_hash_algo (sha256_cbor)."),
    store: Optional[str] = STORE_OPTION,
    api: Optional[str] = TARGET_API_OPTION, token_file: Optional[Path] = TOKEN_FILE_OPTION, json_out: bool = JSON_OPTION,
):
    """How many tokens of a prompt are stored, and in which tiers (through the API with --api, else in --store)."""
    fields: dict[str, Any] = dict(model=model, salt=salt, recipe=recipe, chunk_tokens=chunk_tokens, scheme=scheme,
                  block_size=block_size, kv_dtype=kv_dtype, tp_size=tp_size, hash_algo=hash_algo)
    ids = _token_ids(tokens, tokens_file)
    with _target(store, api, token_file, reads_only=True) as target:
        result = target.lookup(ids, fields)
    if json_out:
        print_json(result)
        return
    typer.echo(f"{result['stored_tokens']} of {result['tokens']} tokens stored in {len(result['chunks'])} entries"
               + "".join(f"; {n} in {tier}" for tier, n in result["tokens_by_tier"].items()))
    rows = [{"key": ",".join(c["keys"]), "tokens": c["tokens"], "tier": ",".join(t or "-" for t in c["tiers"])}
            for c in result["chunks"]]
    if rows:
        print_table(rows, ["key", "tokens", "tier"])


@store_app.command("events", cls=Command)
def events(
    count: Optional[int] = typer.Option(None, "--count", "-n", min=1, help="Stop after this many events."),
    api: Optional[str] = API_OPTION, token_file: Optional[Path] = TOKEN_FILE_OPTION, json_out: bool = JSON_OPTION,
):
    """Print the server's events as they happen (stored, promoted, demoted, evicted, pinned, hinted, ...)."""
    with _server(api, token_file) as target:
        for seen, event in enumerate(target.events(), start=1):
            data = event["data"]
            if json_out:
                typer.echo(json.dumps(event))
            else:
                where = f"{data.get('from_tier')} -> {data.get('tier')}" if data.get("from_tier") else data.get("tier")
                typer.echo(f"{event['event']:>9}  {data.get('key', '')}  {where or '-'}  {data.get('reason', '')}".rstrip())
            if count is not None and seen >= count:
                return


def _token_ids(text: Optional[str], path: Optional[Path]) -> list[int]:
    if (text is None) == (path is None):
        raise UsageError("give the prompt's token ids with --tokens or --tokens-file")
    if path is not None:
        text = typer.get_text_stream("stdin").read() if str(path) == "-" else existing_file(path).read_text()
    assert text is not None  # exactly one of the two is given, checked above
    text = text.strip()
    try:
        ids = json.loads(text) if text.startswith("[") else [int(t) for t in text.replace(",", " ").split()]
    except ValueError as exc:
        raise UsageError(f"token ids must be integers: {exc}") from None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise UsageError("token ids must be a list of integers")
    return ids



def register(app: typer.Typer) -> None:
    app.add_typer(store_app, name="store")
