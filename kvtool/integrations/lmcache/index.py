"""What the adapter knows its store holds, the entries LMCache has locked, and what it has counted; thread-safe.

LMCache keeps per-salt byte totals and, for some policies, its own view of the
L2 keys; the adapter tells it of every chunk it stores, deletes or finds again
after a restart (``reindex``). Lookups never trust this index: they ask the
store, which other processes (a shared file tier, Redis) may have filled.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Generic, Hashable, TypeVar

from kvtool.entries.names import LMCACHE_PREFIX, ChunkName
from kvtool.errors import KvtoolError
from kvtool.store import Store

log = logging.getLogger("kvtool.lmcache")

K = TypeVar("K", bound=Hashable)


class ChunkIndex(Generic[K]):
    """LMCache key -> (store key, bytes), and back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[K, tuple[str, int]] = {}
        self._by_store_key: dict[str, K] = {}

    def add(self, key: K, store_key: str, size: int) -> bool:
        """Record a stored chunk; False if it was known already (then nothing changes)."""
        with self._lock:
            if key in self._by_key:
                return False
            self._by_key[key] = (store_key, size)
            self._by_store_key[store_key] = key
            return True

    def pop(self, key: K) -> int | None:
        with self._lock:
            known = self._by_key.pop(key, None)
            if known is None:
                return None
            self._by_store_key.pop(known[0], None)
            return known[1]

    def pop_store_key(self, store_key: str) -> tuple[K, int] | None:
        with self._lock:
            key = self._by_store_key.pop(store_key, None)
            if key is None:
                return None
            return key, self._by_key.pop(key)[1]

    def items(self) -> tuple[list[K], list[int]]:
        with self._lock:
            return list(self._by_key), [size for _, size in self._by_key.values()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)


class Locks:
    """LMCache's locks on entries between a lookup and the load that follows: a locked entry is pinned in the store
    (no eviction of the store's own takes it) until as many unlocks as locks have come."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def take(self, store_key: str) -> bool:
        """Lock an entry the store holds; False if it is gone (then it is no hit)."""
        with self._lock:
            if self._counts.get(store_key, 0) > 0:
                self._counts[store_key] += 1
                return True
            try:
                pinned = self._store.pin(store_key)
            except KvtoolError as exc:
                log.warning("kvtool L2 adapter: cannot lock a chunk (%s)", exc)
                return False
            if pinned:
                self._counts[store_key] = 1
            return pinned

    def release(self, store_key: str) -> None:
        with self._lock:
            left = self._counts.get(store_key, 0) - 1
            if left > 0:
                self._counts[store_key] = left
                return
            if self._counts.pop(store_key, None) is None:
                return
            try:
                self._store.unpin(store_key)
            except KvtoolError as exc:  # a closed store: nothing left to hold
                log.debug("kvtool L2 adapter: unlocking a chunk: %s", exc)

    def forget(self, store_key: str) -> None:
        """A deleted entry holds no lock any more."""
        with self._lock:
            self._counts.pop(store_key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._counts)


def reindex(store: Store, recipe: str, make_key: Callable[[ChunkName], K]) -> tuple[list[K], list[str], list[int]]:
    """The chunks of ``recipe`` a store holds (from entry metadata alone): keys, store keys, record sizes.

    Entries whose metadata does not hash to their key, of another recipe, or
    that ``make_key`` refuses (``ValueError``) are left out.
    """
    found: tuple[list[K], list[str], list[int]] = ([], [], [])
    for store_key in store.keys():
        if not store_key.startswith(LMCACHE_PREFIX):
            continue
        info = store.info(store_key)
        name = None if info is None else ChunkName.from_meta(store_key, info.meta)
        if info is None or name is None or name.recipe != recipe:
            continue
        try:
            key = make_key(name)
        except ValueError:
            continue
        found[0].append(key)
        found[1].append(store_key)
        found[2].append(info.size)
    return found


class Counters:
    """Named counts and sums (``name|label`` for a labelled one, as kvtool's vLLM connector writes them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}

    def add(self, name: str, amount: float = 1, label: str | None = None) -> None:
        key = name if label is None else f"{name}|{label}"
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(sorted(self._values.items()))
