"""``kvtool store``: put, get, list, inspect and evict entries of a KV cache store.

The last section drives a running API server (``kvtool serve``, or vLLM with the API on):
pin, unpin, prefetch, offload, hint, lookup and events, with ``--api URL``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import typer

from kvtool.cli._common import JSON_OPTION, Command, Group, existing_file, print_json, print_result, print_table
from kvtool.errors import KvtoolError, UsageError
from kvtool.fileio import atomic_write
from kvtool.store import Store, TieredStore, open_store
from kvtool.store.file import default_path
from kvtool.store.metrics import prometheus_text
from kvtool.units import format_size

store_app = typer.Typer(
    cls=Group,
    name="store",
    help="Put, get, list and evict entries of a KV cache store (memory, file, redis, or tiers of them).",
    no_args_is_help=True,
)

STORE_OPTION = typer.Option(
    None,
    "--store",
    "-s",
    envvar="KVTOOL_STORE",
    show_default=False,
    help="Store URL, or comma-separated URLs fastest tier first: memory://?capacity=2GiB, "
    "file:///path?capacity=100GiB, redis://host:6379/0?ttl=3600, redis+cluster://host:7000,host2:7000/?ttl=3600. "
    "Default: a file store in $XDG_CACHE_HOME/kvtool/store (~/.cache/kvtool/store).",
)

API_OPTION = typer.Option(
    None, "--api", envvar="KVTOOL_API", show_default=False,
    help="URL of a kvtool API server: http://127.0.0.1:8470 (the default of `kvtool serve`) or unix:///PATH.",
)
TOKEN_FILE_OPTION = typer.Option(
    None, "--token-file", show_default=False,
    help="File holding the API's bearer token ($KVTOOL_API_TOKEN overrides it; default ~/.config/kvtool/api-token).",
)


def default_store_url() -> str:
    """A file store under the user's cache directory, which outlives the process."""
    return f"file://{default_path()}"


def _open(url: Optional[str], read_only: bool = False) -> Store:
    return open_store(url or default_store_url(), read_only=read_only)


def _open_to_report(url: Optional[str]) -> Store:
    """A store opened read-only whose every tier answers, for commands that report contents:
    a tier that is down is an error, not an empty tier."""
    store = _open(url, read_only=True)
    try:
        for tier in store.tiers if isinstance(store, TieredStore) else [store]:
            tier.check_reachable()
    except BaseException:
        store.close()
        raise
    return store


@store_app.command("put", cls=Command)
def put(
    key: str = typer.Argument(..., help="Key to store the value under."),
    source: str = typer.Argument(..., help="File to store, or - for standard input."),
    store: Optional[str] = STORE_OPTION,
    tokens: Optional[int] = typer.Option(
        None, "--tokens", min=0, show_default=False,
        help="Tokens of KV cache the value holds (kept as metadata). Default: read from a .kvz value's header.",
    ),
    json_out: bool = JSON_OPTION,
):
    """Store a file (or standard input) under KEY."""
    started = time.perf_counter()
    data = typer.get_binary_stream("stdin").read() if source == "-" else existing_file(Path(source)).read_bytes()
    if tokens is None:
        tokens = kvz_tokens(data)
    with _open(store) as s:
        if not s.put(key, data, {} if tokens is None else {"tokens": tokens}):
            raise KvtoolError(f"{key!r} was not stored in {s.describe()} (the reason is logged above)")
        where = s.describe()
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
):
    """Write the value stored under KEY to standard output or a file; exit 1 if there is none."""
    with _open(store) as s:
        value = s.get(key)
        if value is None:
            raise KvtoolError(f"no entry {key!r} in {s.describe()}")
    if output is None:
        out = typer.get_binary_stream("stdout")
        out.write(value)
        out.flush()
    else:
        with atomic_write(output) as f:
            f.write(value)


@store_app.command("ls", cls=Command)
def ls(store: Optional[str] = STORE_OPTION, json_out: bool = JSON_OPTION):
    """List the entries: key, tier, stored size and token count (reads only: changes nothing)."""
    with _open_to_report(store) as s:
        rows: list[dict[str, Any]] = []
        for key in s.keys():
            info = s.info(key)
            if info is None:
                continue
            tier = s.tier_of(key) if isinstance(s, TieredStore) else s.name
            rows.append({"key": key, "tier": tier, "bytes": info.size, "tokens": info.tokens})
    if json_out:
        print_json(rows)
    elif rows:
        shown = [{**r, "size": format_size(r["bytes"])} for r in rows]
        print_table(shown, ["key", "tier", "size", "tokens"])


@store_app.command("stats", cls=Command)
def stats(
    store: Optional[str] = STORE_OPTION,
    json_out: bool = JSON_OPTION,
    prometheus: bool = typer.Option(
        False, "--prometheus", help="Print Prometheus text exposition format (needs the metrics extra)."
    ),
):
    """What the store holds, per tier: entries, bytes, capacity (reads only: changes nothing).

    --json and --prometheus add this process's counters (hits, bytes read, ...),
    which start at zero: a store's activity is in the metrics of the processes using it.
    """
    with _open_to_report(store) as s:
        data = s.stats()
    if json_out:
        print_json(data)
        return
    if prometheus:
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
        })
    print_table(rows, ["tier", "store", "entries", "used", "capacity"])


@store_app.command("evict", cls=Command)
def evict(
    keys: list[str] = typer.Argument(..., help="Keys to remove."),
    store: Optional[str] = STORE_OPTION,
    api: Optional[str] = typer.Option(
        None, "--api", show_default=False, help="Evict through this kvtool API server instead of opening --store."
    ),
    token_file: Optional[Path] = TOKEN_FILE_OPTION,
    json_out: bool = JSON_OPTION,
):
    """Remove KEYS from every tier (of a store, or of a server with --api); exit 1 if one was not there."""
    if api is not None:
        return _api_action("evict", keys, api, token_file, json_out)
    with _open(store) as s:
        for key in keys:
            removed = s.evict(key) if isinstance(s, TieredStore) else s.delete(key)
            if not removed:
                raise KvtoolError(f"no entry {key!r} in {s.describe()}")


# --- the same store through a running `kvtool serve` (or a vLLM server with the API on) ---------------

KEYS_ARGUMENT = typer.Argument(..., help="Keys of the entries.", show_default=False)


def _client(api: Optional[str], token_file: Optional[Path]):
    from kvtool.server.client import DEFAULT_URL, ApiClient

    return ApiClient(api or DEFAULT_URL, token_file=token_file)


def _api_action(action: str, keys: list[str], api: Optional[str], token_file: Optional[Path], json_out: bool,
                **options) -> None:
    """Run one per-key action through the API, print its answer, and fail if a key did not succeed."""
    with _client(api, token_file) as client:
        answer = getattr(client, action)(keys, **options)
    if json_out:
        print_json(answer)
    else:
        print_table([{**r, "tier": r["tier"] or "-"} for r in answer["results"]], ["key", "status", "tier"])
    failed = [r for r in answer["results"] if not r["ok"]]
    if failed:
        listed = ", ".join(f"{r['key'][:40]} ({r['status']})" for r in failed[:5])
        raise KvtoolError(f"{len(failed)} of {len(answer['results'])} keys not done: {listed}")


@store_app.command("pin", cls=Command)
def pin(keys: list[str] = KEYS_ARGUMENT, api: Optional[str] = API_OPTION,
        token_file: Optional[Path] = TOKEN_FILE_OPTION, json_out: bool = JSON_OPTION):
    """Keep entries where they are until unpinned (never demoted or evicted), through the API."""
    _api_action("pin", keys, api, token_file, json_out)


@store_app.command("unpin", cls=Command)
def unpin(keys: list[str] = KEYS_ARGUMENT, api: Optional[str] = API_OPTION,
          token_file: Optional[Path] = TOKEN_FILE_OPTION, json_out: bool = JSON_OPTION):
    """Let pinned entries move and leave again, through the API."""
    _api_action("unpin", keys, api, token_file, json_out)


@store_app.command("prefetch", cls=Command)
def prefetch(
    keys: list[str] = KEYS_ARGUMENT,
    wait: bool = typer.Option(False, "--wait", help="Return when the entries are in the fastest tier."),
    api: Optional[str] = API_OPTION, token_file: Optional[Path] = TOKEN_FILE_OPTION, json_out: bool = JSON_OPTION,
):
    """Bring entries to the fastest tier ahead of the request that needs them, through the API."""
    _api_action("prefetch", keys, api, token_file, json_out, wait=wait)


@store_app.command("offload", cls=Command)
def offload(
    keys: list[str] = KEYS_ARGUMENT,
    to: str = typer.Option("-1", "--to", help="Tier name or number (0 the fastest, -1 the slowest)."),
    api: Optional[str] = API_OPTION, token_file: Optional[Path] = TOKEN_FILE_OPTION, json_out: bool = JSON_OPTION,
):
    """Move entries down now (a session pauses), through the API."""
    target = int(to) if to.lstrip("-").isdigit() else to
    _api_action("offload", keys, api, token_file, json_out, to=target)


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
    _api_action("hint", keys, api, token_file, json_out, returns_in_s=returns_in, offload=offload_now,
                prefetch_ahead_s=prefetch_ahead)


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
    api: Optional[str] = API_OPTION, token_file: Optional[Path] = TOKEN_FILE_OPTION, json_out: bool = JSON_OPTION,
):
    """How many tokens of a prompt are stored, and in which tiers (through the API with --api, else in --store)."""
    fields: dict[str, Any] = dict(model=model, salt=salt, recipe=recipe, chunk_tokens=chunk_tokens, scheme=scheme,
                  block_size=block_size, kv_dtype=kv_dtype, tp_size=tp_size, hash_algo=hash_algo)
    ids = _token_ids(tokens, tokens_file)
    if api is not None:
        with _client(api, token_file) as client:
            result = client.lookup(ids, **fields)
    else:
        from kvtool.server.lookup import PrefixQuery, lookup_prefix

        query = PrefixQuery(ids, **fields).with_defaults({})
        with _open(store) as s:
            found = lookup_prefix(s, query)
        result = {**asdict(found), "keys": found.keys}
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
    with _client(api, token_file) as client:
        for seen, event in enumerate(client.events(), start=1):
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
