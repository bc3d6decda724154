"""What ``kvtool store`` acts on: a store this process opens (``--store``), or a running
API server's store (``--api``: ``kvtool serve``, or vLLM with the API on).

Both targets answer the same verbs with the same shapes, so each command is written
once. The scheduling verbs (pin, unpin, prefetch, offload, hint, events) need a store
that outlives the command: only a server (``ApiTarget``) has them.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol, Sequence

from kvtool.errors import KvtoolError
from kvtool.store import Store, open_store
from kvtool.store.file import default_path

log = logging.getLogger("kvtool.cli.store")

#: The answer to a per-key verb: ``{"results": [{"key", "ok", "status", "tier"}, ...]}``, as the API gives it.
KeyResults = dict[str, Any]


class Target(Protocol):
    def describe(self) -> str: ...
    def put(self, key: str, value: bytes, tokens: int | None) -> None: ...
    def get(self, key: str) -> bytes | None: ...
    def entries(self) -> list[dict[str, Any]]: ...
    def stats(self) -> dict[str, Any]: ...
    def evict(self, keys: Sequence[str]) -> KeyResults: ...
    def lookup(self, ids: list[int], fields: dict[str, Any]) -> dict[str, Any]: ...
    def close(self) -> None: ...


def default_store_url() -> str:
    """A file store under the user's cache directory, which outlives the process."""
    return f"file://{default_path()}"


def open_target(store: Optional[str], api: Optional[str], token_file: Optional[Path], *,
                writes: bool = False, reads_only: bool = False) -> Target:
    """The API server when ``api`` is given, else the store ``store`` names (default: the user's file store).

    A local store is opened only if it exists, unless the command ``writes`` (a put creates it);
    one that only ``reads_only`` is opened read-only. Every tier must answer: a server that is
    down is "unavailable" (exit 3), never an empty store or a missing entry.
    """
    if api is not None:
        return ApiTarget(api, token_file)
    url = store or default_store_url()
    log.info("opening the store %s", _redacted(url))
    opened = open_store(url, read_only=reads_only, create=writes)
    try:
        for tier in opened.tiers:
            log.info("checking that %s answers", tier.describe())
            tier.check_reachable()
    except BaseException:
        opened.close()
        raise
    return LocalTarget(opened)


def _redacted(url: str) -> str:
    from kvtool.store.url import redact

    return redact(url)


class LocalTarget:
    """A store opened by this command, closed when it ends."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def describe(self) -> str:
        return self.store.describe()

    def put(self, key: str, value: bytes, tokens: int | None) -> None:
        if not self.store.persistent:
            log.warning("%s keeps entries in this process only: %r is gone when the command exits "
                        "(add a persistent tier: --store 'memory://,file://./out/kvcache')", self.describe(), key)
        log.info("putting %r (%d bytes) into %s", key, len(value), self.describe())
        if not self.store.put(key, value, {} if tokens is None else {"tokens": tokens}):
            raise KvtoolError(f"{key!r} was not stored in {self.describe()} (the reason is logged above)")

    def get(self, key: str) -> bytes | None:
        log.info("reading %r from %s", key, self.describe())
        return self.store.get(key)

    def entries(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for key in self.store.keys():
            info = self.store.info(key)
            if info is not None:
                tier = self.store.tier_of(key)
                rows.append({"key": key, "tier": tier, "bytes": info.size, "tokens": info.tokens})
        return rows

    def stats(self) -> dict[str, Any]:
        return self.store.stats()

    def evict(self, keys: Sequence[str]) -> KeyResults:
        results = []
        for key in keys:
            removed = self.store.evict(key)
            log.info("%s %r from %s", "evicted" if removed else "found no", key, self.describe())
            results.append({"key": key, "ok": removed, "status": "evicted" if removed else "missing", "tier": None})
        return {"results": results}

    def lookup(self, ids: list[int], fields: dict[str, Any]) -> dict[str, Any]:
        from kvtool.server.lookup import PrefixQuery, lookup_prefix

        found = lookup_prefix(self.store, PrefixQuery(ids, **fields).with_defaults({}))
        return {**asdict(found), "keys": found.keys}

    def close(self) -> None:
        log.info("closing %s", self.describe())
        self.store.close()


class ApiTarget:
    """The store of a running kvtool API server (default: ``kvtool serve``'s address)."""

    def __init__(self, url: Optional[str], token_file: Optional[Path]) -> None:
        from kvtool.server.client import DEFAULT_URL, ApiClient

        self.client = ApiClient(url or DEFAULT_URL, token_file=token_file)

    def describe(self) -> str:
        return f"the kvtool API at {self.client.url}"

    def put(self, key: str, value: bytes, tokens: int | None) -> None:
        self.client.put(key, value, tokens)

    def get(self, key: str) -> bytes | None:
        return self.client.get(key)

    def entries(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        while True:
            page = self.client.entries(offset=len(rows))
            rows.extend({k: r[k] for k in ("key", "tier", "bytes", "tokens")} for r in page["entries"])
            if not page["entries"] or len(rows) >= page["total"]:
                return rows

    def stats(self) -> dict[str, Any]:
        return self.client.stats()

    def evict(self, keys: Sequence[str]) -> KeyResults:
        return self.client.evict(keys)

    def lookup(self, ids: list[int], fields: dict[str, Any]) -> dict[str, Any]:
        return self.client.lookup(ids, **fields)

    def pin(self, keys: Sequence[str]) -> KeyResults:
        return self.client.pin(keys)

    def unpin(self, keys: Sequence[str]) -> KeyResults:
        return self.client.unpin(keys)

    def prefetch(self, keys: Sequence[str], wait: bool) -> KeyResults:
        return self.client.prefetch(keys, wait=wait)

    def offload(self, keys: Sequence[str], to: str | int) -> KeyResults:
        return self.client.offload(keys, to=to)

    def hint(self, keys: Sequence[str], returns_in_s: float, offload: bool,
             prefetch_ahead_s: float | None) -> KeyResults:
        return self.client.hint(keys, returns_in_s=returns_in_s, offload=offload,
                                prefetch_ahead_s=prefetch_ahead_s)

    def events(self) -> Iterator[dict[str, Any]]:
        return self.client.events()

    def close(self) -> None:
        self.client.close()
