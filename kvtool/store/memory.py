"""The memory tier: records in this process's memory, least recently used evicted first (on its own).

A pinned entry (``Store.pin``) is never evicted to make room: a write that would need its room is refused.
"""

from __future__ import annotations

import threading

from kvtool.errors import UsageError
from kvtool.store.base import Store
from kvtool.store.entry import EntryInfo
from kvtool.store.lru import LruSizes
from kvtool.store.url import parse_options, split_query
from kvtool.units import format_size, parse_size

DEFAULT_CAPACITY = 1024**3


class MemoryStore(Store):
    """``memory://?capacity=2GiB``; the capacity defaults to 1 GiB."""

    scheme = "memory"
    typical_latency_s = 2e-6
    typical_bandwidth = 8e9

    def __init__(self, capacity: int | None = DEFAULT_CAPACITY, *, name: str | None = None) -> None:
        super().__init__(capacity=capacity, name=name)
        self._lock = threading.Lock()
        self._records: dict[str, bytes] = {}
        self._lru = LruSizes(capacity)

    @classmethod
    def from_url(cls, url: str) -> "MemoryStore":
        base, _ = split_query(url)
        if base.strip().lower() != "memory://":
            raise UsageError(f"a memory store URL has no location: {base!r} (use memory://?capacity=2GiB)")
        return cls(**parse_options(url, {"capacity": parse_size}))

    def describe(self) -> str:
        return "memory://" + ("" if self.capacity is None else f"?capacity={format_size(self.capacity).replace(' ', '')}")

    @property
    def used_bytes(self) -> int:
        return self._lru.used

    def _read(self, key: str) -> bytes | None:
        with self._lock:
            if self.evicts_by_itself:
                self._lru.touch(key)
            return self._records.get(key)

    def _write(self, info: EntryInfo, record: bytes) -> bool:
        with self._lock:
            if not self.evicts_by_itself and not self._lru.fits(info.key, len(record)):
                return False
            with self._pin_lock:  # a pinned entry stays: a write that fits only without it is refused
                victims = self._lru.admit(info.key, len(record), keep=self._pinned)
            if victims is None:
                return False
            freed = sum(len(self._records.pop(victim)) for victim in victims)
            self._records[info.key] = record
        self._evicted(victims, freed)
        return True

    def _delete(self, key: str) -> bool:
        with self._lock:
            self._records.pop(key, None)
            return self._lru.remove(key)

    def _contains(self, key: str) -> bool:
        with self._lock:
            return key in self._records

    def _count(self) -> int:
        with self._lock:
            return len(self._records)

    def _keys(self) -> list[str]:
        with self._lock:
            return self._lru.keys()

    def _close(self) -> None:
        with self._lock:
            self._records.clear()
            self._lru = LruSizes(self.capacity)
