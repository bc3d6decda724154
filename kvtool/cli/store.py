"""``kvtool store``: put, get, list, inspect and evict entries of a KV cache store."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from kvtool.cli._common import JSON_OPTION, existing_file, print_json, print_table
from kvtool.errors import KvtoolError
from kvtool.fileio import atomic_write
from kvtool.store import Store, TieredStore, open_store
from kvtool.units import format_size

store_app = typer.Typer(
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
    "file:///path?capacity=100GiB, redis://host:6379/0?ttl=3600. "
    "Default: a file store in $XDG_CACHE_HOME/kvtool/store (~/.cache/kvtool/store).",
)


def default_store_url() -> str:
    """A file store under the user's cache directory, which outlives the process."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return "file://" + str(Path(cache) / "kvtool" / "store")


def _open(url: Optional[str]) -> Store:
    return open_store(url or default_store_url())


def _open_to_report(url: Optional[str]) -> Store:
    """A store whose every tier answers, for commands that report contents: a tier that is down is an error, not empty."""
    store = _open(url)
    try:
        for tier in store.tiers if isinstance(store, TieredStore) else [store]:
            tier.check_reachable()
    except BaseException:
        store.close()
        raise
    return store


@store_app.command("put")
def put(
    key: str = typer.Argument(..., help="Key to store the value under."),
    source: str = typer.Argument(..., help="File to store, or - for standard input."),
    store: Optional[str] = STORE_OPTION,
    tokens: Optional[int] = typer.Option(
        None, "--tokens", min=0, help="Tokens of KV cache the value holds (kept as metadata)."
    ),
):
    """Store a file (or standard input) under KEY."""
    data = typer.get_binary_stream("stdin").read() if source == "-" else existing_file(Path(source)).read_bytes()
    with _open(store) as s:
        if not s.put(key, data, {} if tokens is None else {"tokens": tokens}):
            raise KvtoolError(f"{key!r} was not stored in {s.describe()} (the reason is logged above)")


@store_app.command("get")
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


@store_app.command("ls")
def ls(store: Optional[str] = STORE_OPTION, json_out: bool = JSON_OPTION):
    """List the entries: key, tier, stored size and token count."""
    with _open_to_report(store) as s:
        rows = []
        for key in s.keys():
            info = s.info(key)
            if info is None:
                continue
            tier = s.tier_of(key) if isinstance(s, TieredStore) else s.name
            rows.append({"key": key, "tier": tier, "bytes": info.size, "tokens": info.tokens})
    if json_out:
        print_json(rows)
    elif rows:
        shown = [{**r, "tokens": "" if r["tokens"] is None else r["tokens"]} for r in rows]
        print_table(shown, ["key", "tier", "bytes", "tokens"])


@store_app.command("stats")
def stats(store: Optional[str] = STORE_OPTION, json_out: bool = JSON_OPTION):
    """What the store holds, per tier: entries, bytes, capacity."""
    with _open_to_report(store) as s:
        data = s.stats()
    if json_out:
        print_json(data)
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


@store_app.command("evict")
def evict(key: str = typer.Argument(..., help="Key to remove."), store: Optional[str] = STORE_OPTION):
    """Remove KEY from every tier; exit 1 if it was not there."""
    with _open(store) as s:
        removed = s.evict(key) if isinstance(s, TieredStore) else s.delete(key)
        if not removed:
            raise KvtoolError(f"no entry {key!r} in {s.describe()}")


def register(app: typer.Typer) -> None:
    app.add_typer(store_app, name="store")
