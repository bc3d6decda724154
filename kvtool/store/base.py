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
(a bad key, a closed store, a write to a store opened read-only) raise
``kvtool.errors.UsageError``. A ``put`` that fails leaves the key's old value
in place.

A store opened ``read_only`` (inspection tools) changes nothing: writes and
deletes raise, a damaged entry is reported as a miss but left where it is, and
reads do not count as uses for eviction order.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Mapping, Sequence

from kvtool.errors import UsageError
from kvtool.store.entry import CorruptEntryError, Entry, EntryInfo, check_key, parse_info, unwrap, wrap
from kvtool.store.keys import PrefixHit, PrefixKeyer, get_prefix, put_prefix
from kvtool.store.metrics import StoreMetrics

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("kvtool.store")

Value = bytes | bytearray | memoryview


class StoreClosedError(UsageError):
    """An operation on a store after ``close()``."""


class ReadOnlyStoreError(UsageError):
    """A write or delete on a store opened read-only."""


@dataclass
class StagedWrite:
    """A write whose slow part is done but which no reader can see yet (``Store.stage_entry``).

    ``commit()`` makes it visible (True) or fails leaving the old value (False);
    ``abort()`` drops it. Exactly one of them must be called.
    """

    commit: Callable[[], bool]
    abort: Callable[[], None]


class Store(ABC):
    """A key -> bytes store with a capacity, integrity checks and metrics.

    Class attributes describe the backend: ``persistent`` (entries outlive the
    process), ``shared`` (other processes may add or remove entries, so an
    in-process index of it cannot be complete), and the typical restore
    latency and bandwidth a cost-aware policy starts from before it has
    measured the tier.
    """

    scheme: ClassVar[str] = ""
    # Set per class; a TieredStore sets them per instance, from its tiers.
    persistent: bool = False
    shared: bool = False
    typical_latency_s: ClassVar[float] = 1e-4
    typical_bandwidth: ClassVar[float] = 1e9  # bytes per second

    def __init__(self, *, capacity: int | None = None, name: str | None = None) -> None:
        if capacity is not None and capacity < 0:
            raise UsageError(f"a store capacity cannot be negative ({capacity})")
        self.capacity = capacity
        self.name = name or self.scheme or type(self).__name__
        self.metrics = StoreMetrics()
        self.read_only = False  # set by open_store(..., read_only=True) before first use
        # Told of the entries a write of this store evicted by itself: (keys, reason). TieredStore listens.
        self.on_evicted: Callable[[list[str], str], None] | None = None
        # False when a TieredStore's policy chooses what leaves this tier: a bounded backend then keeps
        # no eviction order of its own and refuses a write that does not fit instead of evicting.
        self.evicts_by_itself = True
        self._closed = False

    @classmethod
    def from_url(cls, url: str) -> "Store":
        raise UsageError(f"{cls.__name__} cannot be opened from a URL")

    @classmethod
    def open_existing(cls, url: str) -> "Store":
        """The store ``url`` names, opened only if it exists, creating nothing (``MissingStoreError``
        otherwise); a backend that creates nothing when it opens is opened as ``from_url`` does."""
        return cls.from_url(url)

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
        self._check_writable()
        return self.put_entry(wrap(key, value, dict(meta or {})))

    def put_entry(self, entry: Entry) -> bool:
        """Store an already wrapped entry as it is (tiers move entries without re-wrapping)."""
        self._check_writable()
        if not self._fits(entry):
            return False
        return self._counted(entry, self._write(entry, entry.record))

    def stage_entry(self, entry: Entry) -> StagedWrite:
        """Do the slow part of storing ``entry`` now and publish it later with ``commit()``.

        A caller that must publish under its own lock (``TieredStore``'s
        write-behind) stages outside it. Backends whose writes have a slow,
        invisible part (the file tier: writing and syncing the file) override
        ``_stage``; elsewhere the whole write happens in ``commit()``.
        """
        self._check_writable()
        if not self._fits(entry):
            return StagedWrite(lambda: False, lambda: None)
        staged = self._stage(entry)
        return StagedWrite(lambda: self._counted(entry, staged.commit()), staged.abort)

    def get(self, key: str) -> bytes | None:
        """The value stored under ``key``, or None on a miss."""
        entry = self.get_entry(key)
        return None if entry is None else bytes(entry.value)

    def get_entry(self, key: str) -> Entry | None:
        """The verified entry under ``key`` (value and metadata), or None on a miss.

        A record that fails its checks is logged, deleted (unless read-only) and reported as a miss.
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

    def delete(self, key: str, *, evicted: str | None = None) -> bool:
        """Remove ``key``; True if it was there.

        ``evicted`` gives the reason when the entry leaves to make room: it is then
        logged and counted in ``evictions`` instead of ``deletes``.
        """
        check_key(key)
        self._check_writable()
        removed = self._delete(key)
        if removed and evicted:
            self.metrics.count("evictions")
            log.info("%s: evicted %r (%s)", self.name, key, evicted)
        elif removed:
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
        self._check_writable()
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
            "read_only": self.read_only,
            "entries": self._count(),
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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- backend hooks --------------------------------------------------------

    @abstractmethod
    def _read(self, key: str) -> bytes | None:
        """The record under ``key`` or None; remote failures are logged and return None."""

    @abstractmethod
    def _write(self, info: EntryInfo, record: bytes) -> bool:
        """Store ``record`` under ``info.key``, evicting to stay in capacity; False on failure.

        A failed write must leave the key's old record in place.
        """

    def _stage(self, entry: Entry) -> StagedWrite:
        """Prepare ``entry``'s write; ``commit`` publishes it (here: does all of it)."""
        return StagedWrite(lambda: self._write(entry, entry.record), lambda: None)

    @abstractmethod
    def _delete(self, key: str) -> bool:
        """Remove ``key``; True if it was there."""

    @abstractmethod
    def _keys(self) -> list[str]:
        """Every key held."""

    def _contains(self, key: str) -> bool:
        return key in self._keys()

    def _count(self) -> int:
        """How many entries the store holds."""
        return len(self._keys())

    def _info(self, key: str) -> EntryInfo | None:
        record = self._read(key)
        return None if record is None else parse_info(record, len(record))

    def _close(self) -> None:
        """Release resources."""

    # --- shared helpers -----------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.describe()} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.read_only:
            raise ReadOnlyStoreError(f"store {self.describe()} is open read-only")

    def _counted(self, entry: Entry, written: bool) -> bool:
        """Count a finished write of ``entry``."""
        if not written:
            self.metrics.count("put_failures")
            return False
        raw = entry.raw_bytes if entry.raw_bytes is not None else entry.size - entry.value_offset
        self.metrics.stored(raw, entry.size)
        return True

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
        self.metrics.count("corrupt")
        if self.read_only:
            log.warning("%s: entry %r is damaged (%s); treated as a miss (read-only: left in place)",
                        self.name, key, reason)
            return
        log.warning("%s: entry %r is damaged (%s); dropped and treated as a miss", self.name, key, reason)
        self._delete(key)

    def _evicted(self, keys: list[str], freed: int) -> None:
        """Count and log the entries a write removed to stay within capacity."""
        if keys:
            self.metrics.count("evictions", len(keys))
            log.info("%s: evicted %d entries (%d bytes) to stay within a capacity of %s bytes",
                     self.name, len(keys), freed, self.capacity)
            if self.on_evicted is not None:
                self.on_evicted(keys, f"{self.name} full")
