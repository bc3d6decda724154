"""Stores for KV cache entries: memory, file and Redis tiers, stacked by ``TieredStore``.

>>> from kvtool.store import open_store
>>> with open_store("memory://?capacity=64MiB") as store:
...     store.put("greeting", b"hello")
...     store.get("greeting")
True
b'hello'

``open_store`` picks the backend by URL scheme through a registry (entry-point
group ``kvtool.stores``); a comma-separated list of URLs builds a
``TieredStore``, fastest tier first::

    open_store("memory://?capacity=2GiB,file:///var/cache/kvtool?capacity=100GiB,redis://cache:6379/0?ttl=3600")

A Redis Cluster's node list stays one tier: ``redis+cluster://10.0.0.1:7000,10.0.0.2:7000/?ttl=3600``.
"""

from __future__ import annotations

from kvtool.errors import UsageError
from kvtool.registry import Registry
from kvtool.store.base import ReadOnlyStoreError, Store, StoreClosedError
from kvtool.store.entry import Entry, EntryInfo
from kvtool.store.events import EVENT_KINDS, StoreEvent
from kvtool.store.keys import PrefixHit, PrefixKeyer, prefix_keys
from kvtool.store.policy import CostAwarePolicy, LRUPolicy, Policy
from kvtool.store.results import Fetched, MissCause
from kvtool.store.tiered import TieredStore
from kvtool.store.url import redact, scheme_of, split_urls

registry: Registry[Store] = Registry(
    "store",
    "kvtool.stores",
    {
        "memory": "kvtool.store.memory:MemoryStore",
        "file": "kvtool.store.file:FileStore",
        "redis": ("kvtool.store.redis:RedisStore", "redis"),
        "rediss": ("kvtool.store.redis:RedisStore", "redis"),
        "redis+cluster": ("kvtool.store.redis_cluster:RedisClusterStore", "redis"),
        "rediss+cluster": ("kvtool.store.redis_cluster:RedisClusterStore", "redis"),
    },
)


def open_store(
    url: str, policy: Policy | None = None, promote: bool = True, read_only: bool = False, write_behind: int = 0,
    create: bool = True,
) -> Store:
    """Open the store a URL names; several comma-separated URLs make a ``TieredStore``.

    ``policy``, ``promote`` and ``write_behind`` apply to a tiered store. Commas separate tiers,
    except before the ``host:port`` of a cluster's next node and inside credentials (a
    comma in a password stays in its URL; see ``split_urls``). ``read_only`` opens it for
    inspection: nothing on disk or in a server changes (``Store`` says what that means).
    ``create=False`` opens only stores that exist (a file store's directory and index), creating none.
    """
    urls = split_urls(url)
    if not all(urls):
        raise UsageError(f"empty tier in store URL list {redact(url)!r}")
    tiers: list[Store] = []
    try:
        for one in urls:
            backend = registry.get(scheme_of(one))
            tiers.append(backend.from_url(one) if create else backend.open_existing(one))
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    if len(tiers) == 1 and policy is None:
        store = tiers[0]
    else:
        store = TieredStore(tiers, policy=policy, promote=promote, write_behind=write_behind)
    store.read_only = read_only
    return store


def as_stack(store: Store) -> TieredStore:
    """``store`` as a ``TieredStore`` (for what needs a placement policy, the HTTP API): itself if it is one,
    else a one-tier stack over it, which then owns it (closing the stack closes it)."""
    return store if isinstance(store, TieredStore) else TieredStore([store])

__all__ = [
    "EVENT_KINDS",
    "CostAwarePolicy",
    "Entry",
    "EntryInfo",
    "Fetched",
    "LRUPolicy",
    "MissCause",
    "Policy",
    "PrefixHit",
    "PrefixKeyer",
    "ReadOnlyStoreError",
    "Store",
    "StoreClosedError",
    "StoreEvent",
    "TieredStore",
    "as_stack",
    "open_store",
    "prefix_keys",
    "registry",
]
