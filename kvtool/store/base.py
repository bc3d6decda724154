"""The ``Store`` interface every tier implements, and the checks they share.

A store maps string keys to bytes values. Each value is kept wrapped in a
record (``kvtool.store.entry``) that carries its key, small JSON metadata and a
checksum, so every backend turns a damaged value into a miss with a logged
reason. Backends implement four small hooks (``_read``, ``_write``,
``_delete``, ``_keys``; ``_contains``, ``_info`` and ``_close`` where they can
do better than the defaults); the public calls, key checks, capacity check,
integrity check and metrics live here once.

Failures of a remote backend in the caller's path (server down, timeout) are
misses and ``False`` from ``put``, never exceptions; mistakes a caller can fix
(a bad key, a closed store) raise ``kvtool.errors.UsageError``.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Iterable, Mapping, Sequence

from kvtool.errors import UsageError
from kvtool.store.entry import CorruptEntryError, Entry, EntryInfo, check_key, parse_info, unwrap, wrap
from kvtool.store.keys import PrefixHit, PrefixKeyer, get_prefix, put_prefix
from kvtool.store.metrics import StoreMetrics

log = logging.getLogger("kvtool.store")

Value = bytes | bytearray | memoryview


class StoreClosedError(UsageError):
    """An operation on a store after ``close()``."""


class Store(ABC):
    """A key -> bytes store with a capacity, integrity checks and metrics.

    Class attributes describe the backend: ``persistent`` (entries outlive the
    process), ``shared`` (other processes may add or remove entries, so an
    in-process index of it cannot be complete), and the typical restore
    latency and bandwidth a cost-aware policy starts from before it has
    measured the tier.
    """

    scheme: ClassVar[str] = ""
    persistent: ClassVar[bool] = False
    shared: ClassVar[bool] = False
    typical_latency_s: ClassVar[float] = 1e-4
    typical_bandwidth: ClassVar[float] = 1e9  # bytes per second

    def __init__(self, *, capacity: int | None = None, name: str | None = None) -> None:
        if capacity is not None and capacity < 0:
            raise UsageError(f"a store capacity cannot be negative ({capacity})")
        self.capacity = capacity
        self.name = name or self.scheme or type(self).__name__
        self.metrics = StoreMetrics()
        self._closed = False

    @classmethod
    def from_url(cls, url: str) -> "Store":
        raise UsageError(f"{cls.__name__} cannot be opened from a URL")

    def describe(self) -> str:
        """A URL-like description with no secret in it, for messages and ``repr``."""
        return f"{self.scheme}://"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"

    # --- single-entry calls -------------------------------------------------

    def put(self, key: str, value: Value, meta: Mapping[str, Any] | None = None) -> bool:
        """Store ``value`` under ``key``, replacing any old value; ``False`` if it was not stored.

        ``meta`` is small JSON-safe metadata kept with the value (see
        ``kvtool.store.entry``: ``tokens``, ``raw_bytes``).
        """
        self._check_open()
        return self.put_entry(wrap(key, value, dict(meta or {})))

    def put_entry(self, entry: Entry) -> bool:
        """Store an already wrapped entry as it is (tiers move entries without re-wrapping)."""
        self._check_open()
        if not self._fits(entry):
            return False
        if not self._write(entry, entry.record):
            self.metrics.count("put_failures")
            return False
        raw = entry.raw_bytes if entry.raw_bytes is not None else entry.size - entry.value_offset
        self.metrics.stored(raw, entry.size)
        return True

    def get(self, key: str) -> bytes | None:
        """The value stored under ``key``, or None on a miss."""
        entry = self.get_entry(key)
        return None if entry is None else bytes(entry.value)

    def get_entry(self, key: str) -> Entry | None:
        """The verified entry under ``key`` (value and metadata), or None on a miss.

        A record that fails its checks is logged, deleted and reported as a miss.
        """
        start = time.perf_counter()
        entry = self.peek(key)
        elapsed = time.perf_counter() - start
        if entry is None:
            self.metrics.miss(elapsed)
        else:
            self.metrics.hit(elapsed, entry.size)
        return entry

    def peek(self, key: str) -> Entry | None:
        """Like ``get_entry``, but not counted as a hit or miss (for moving entries between tiers)."""
        check_key(key)
        self._check_open()
        record = self._read(key)
        return None if record is None else self._verified(key, record)

    def info(self, key: str) -> EntryInfo | None:
        """Size and metadata of the entry under ``key`` without verifying its value."""
        check_key(key)
        self._check_open()
        try:
            return self._info(key)
        except CorruptEntryError as exc:
            self._drop_corrupt(key, exc)
            return None

    def contains(self, key: str) -> bool:
        check_key(key)
        self._check_open()
        return self._contains(key)

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was there."""
        check_key(key)
        self._check_open()
        removed = self._delete(key)
        if removed:
            self.metrics.count("deletes")
        return removed

    def keys(self) -> list[str]:
        self._check_open()
        return self._keys()

    def check_reachable(self) -> None:
        """Raise ``StoreUnreachableError`` if the backend cannot be reached now.

        Calls in the caller's path turn an unreachable server into misses; a
        command that reports what a store holds asks first, so that a server
        that is down is not shown as an empty store. Local backends are always
        reachable.
        """

    @property
    def used_bytes(self) -> int | None:
        """Bytes held by this store's records, or None where the backend cannot tell."""
        return None

    # --- batches: loops by default, for backends to speed up ----------------

    def put_many(self, items: Mapping[str, Value] | Iterable[tuple[str, Value]]) -> list[bool]:
        pairs = items.items() if isinstance(items, Mapping) else items
        return [self.put(key, value) for key, value in pairs]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(key) for key in keys]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.contains(key) for key in keys]

    # --- prefixes: one entry per chunk of tokens (kvtool.store.keys) ----------

    def put_prefix(
        self, keyer: PrefixKeyer, tokens: Sequence[int], chunks: Sequence[Value], meta: Mapping[str, Any] | None = None
    ) -> int:
        """Store the caches of the chunks of ``tokens``; how many chunks were stored."""
        return put_prefix(self, keyer, tokens, chunks, meta)

    def get_prefix(self, keyer: PrefixKeyer, tokens: Sequence[int]) -> PrefixHit:
        """The longest cached prefix of ``tokens``: its chunks' values and token count."""
        return get_prefix(self, keyer, tokens)

    # --- verbatim record access (tools, fault injection) -------------------

    def read_record(self, key: str) -> bytes | None:
        """The stored bytes under ``key`` exactly as kept, unchecked."""
        check_key(key)
        self._check_open()
        return self._read(key)

    def write_record(self, key: str, record: bytes) -> bool:
        """Store ``record`` verbatim under ``key``, unchecked: reads verify it later."""
        check_key(key)
        self._check_open()
        info = EntryInfo(key, len(record), {})
        return self._fits(info) and self._write(info, bytes(record))

    # --- lifecycle and reporting --------------------------------------------

    def stats(self) -> dict[str, Any]:
        """A JSON-safe dict: what the store holds and what it has done."""
        self._check_open()
        return {
            "name": self.name,
            "store": self.describe(),
            "persistent": self.persistent,
            "shared": self.shared,
            "entries": len(self._keys()),
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity,
            **self.metrics.snapshot(),
        }

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the store's resources; later calls raise ``StoreClosedError``. Idempotent."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- backend hooks --------------------------------------------------------

    @abstractmethod
    def _read(self, key: str) -> bytes | None:
        """The record under ``key`` or None; remote failures are logged and return None."""

    @abstractmethod
    def _write(self, info: EntryInfo, record: bytes) -> bool:
        """Store ``record`` under ``info.key``, evicting to stay in capacity; False on failure."""

    @abstractmethod
    def _delete(self, key: str) -> bool:
        """Remove ``key``; True if it was there."""

    @abstractmethod
    def _keys(self) -> list[str]:
        """Every key held."""

    def _contains(self, key: str) -> bool:
        return key in self._keys()

    def _info(self, key: str) -> EntryInfo | None:
        record = self._read(key)
        return None if record is None else parse_info(record, len(record))

    def _close(self) -> None:
        """Release resources."""

    # --- shared helpers -----------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.describe()} is closed")

    def _fits(self, info: EntryInfo) -> bool:
        if self.capacity is not None and info.size > self.capacity:
            log.warning(
                "%s: not storing %r: %d bytes exceed the capacity of %d", self.name, info.key, info.size, self.capacity
            )
            self.metrics.count("put_failures")
            return False
        return True

    def _verified(self, key: str, record: bytes) -> Entry | None:
        try:
            return unwrap(record, key)
        except CorruptEntryError as exc:
            self._drop_corrupt(key, exc)
            return None

    def _drop_corrupt(self, key: str, reason: Exception) -> None:
        log.warning("%s: entry %r is damaged (%s); dropped and treated as a miss", self.name, key, reason)
        self.metrics.count("corrupt")
        self._delete(key)

    def _evicted(self, keys: list[str]) -> None:
        if keys:
            self.metrics.count("evictions", len(keys))
            log.debug("%s: evicted %d entries to stay within capacity", self.name, len(keys))
