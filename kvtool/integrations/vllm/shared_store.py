"""One open store per process and URL, shared by the connector instances in it.

With vLLM's single-process executor the scheduler-side and worker-side
connectors live in one process; they use one store object, so the scheduler
sees the worker's memory tier at once and the store's threads and write-behind
queue exist once. In separate processes each opens its own and they meet in
the shared tiers.
"""

from __future__ import annotations

import threading

from kvtool.store import Store, open_store

_lock = threading.Lock()
_open: dict[str, tuple[Store, int]] = {}


def acquire(url: str, write_behind: int = 0) -> Store:
    """The process's store for ``url`` (opened on first use, with ``write_behind`` if tiered)."""
    with _lock:
        store, users = _open.get(url, (None, 0))
        if store is None:
            store = open_store(url, write_behind=write_behind)
        _open[url] = (store, users + 1)
        return store


def release(url: str) -> None:
    """Close the store when its last user releases it (a tiered store then saves its memory tier)."""
    with _lock:
        store, users = _open.get(url, (None, 0))
        if store is None:
            return
        if users > 1:
            _open[url] = (store, users - 1)
            return
        del _open[url]
    store.close()
