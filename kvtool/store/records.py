"""The record-level half of ``Store``: the single-entry calls every backend implements, and their checks.

A store maps string keys to bytes values. Each value is kept wrapped in a
record (``kvtool.store.entry``) that carries its key, small JSON metadata and a
checksum, so every backend turns a damaged value into a miss with a logged
reason. Backends implement four small hooks (``_read``, ``_write``,
``_delete``, ``_keys``; ``_contains``, ``_info``, ``_close`` and ``_read_result``
where they can do better than the defaults); the public calls, key checks,
capacity check, integrity check, metrics and single-tier events live here once.

Failures of a remote backend in the caller's path (server down, timeout) are
misses and ``False`` from ``put``, never exceptions; ``fetch`` says which
(``kvtool.store.results``: missing, damaged, unreachable). Mistakes a caller can fix
(a bad key, a closed store, a write to a store opened read-only) raise
``kvtool.errors.UsageError``. A ``put`` that fails leaves the key's old value
in place.

A store opened ``read_only`` (inspection tools) changes nothing: writes and
deletes raise, a damaged entry is reported as a miss but left where it is, and
reads do not count as uses for eviction order.

``kvtool.store.base.Store`` adds batches, prefixes and the tier operations.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

from kvtool.errors import UsageError
from kvtool.store.entry import CorruptEntryError, Entry, EntryInfo, check_key, parse_info, unwrap, wrap
from kvtool.store.events import EventBus, StoreEvent
from kvtool.store.metrics import StoreMetrics
from kvtool.store.results import Fetched, MissCause

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


class RecordStore(ABC):
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
        self.events = EventBus(self.name)
        self._pinned: set[str] = set()
        self._pin_lock = threading.Lock()
        self._closed = False

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
        with self.events.delivering():
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
        return self.fetch(key).entry

    def fetch(self, key: str, *, check_value: bool = True) -> Fetched:
        """The verified entry under ``key``, or why there is none (``missing``, ``damaged``, ``unreachable``).

        Never raises for an entry that is absent, damaged or out of reach; a bad
        key or a closed store still raise ``UsageError``. Counted as a hit or miss.
        Without ``check_value`` the value is not hashed (``entry.unwrap``): for a
        caller that verifies it and reports damage with ``drop_damaged``.
        """
        start = time.perf_counter()
        fetched = self.peek_fetched(key, check_value=check_value)
        elapsed = time.perf_counter() - start
        if fetched.entry is None:
            self.metrics.miss(elapsed)
        else:
            self.metrics.hit(elapsed, fetched.entry.size)
        return fetched

    def peek(self, key: str) -> Entry | None:
        """Like ``get_entry``, but not counted as a hit or miss (for moving entries between tiers)."""
        return self.peek_fetched(key).entry

    def peek_fetched(self, key: str, *, check_value: bool = True) -> Fetched:
        """Like ``fetch``, but not counted as a hit or miss."""
        check_key(key)
        self._check_open()
        record = self._read_result(key)
        if isinstance(record, Fetched):
            return record
        try:
            return Fetched(key, unwrap(record, key, check_value), None, tier=self.name)
        except CorruptEntryError as exc:
            self._drop_corrupt(key, exc)
            return Fetched(key, None, MissCause.DAMAGED, str(exc))

    def drop_damaged(self, key: str, reason: str) -> None:
        """A caller that checked an entry's value itself (``fetch(check_value=False)``) found it damaged: counted,
        logged and dropped, as a failed record check would be (left in place in a store opened read-only)."""
        check_key(key)
        self._check_open()
        self._drop_corrupt(key, CorruptEntryError(reason))

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
        with self.events.delivering():
            removed = self._delete(key)
            if removed and evicted:
                self.metrics.count("evictions")
                log.info("%s: evicted %r (%s)", self.name, key, evicted)
            elif removed:
                self.metrics.count("deletes")
            if removed:
                self._tier_event("evicted", key, evicted or "deleted")
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

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- backend hooks --------------------------------------------------------

    @abstractmethod
    def _read(self, key: str) -> bytes | None:
        """The record under ``key`` or None; remote failures are logged and return None."""

    def _read_result(self, key: str) -> bytes | Fetched:
        """The record under ``key``, or why there is none; backends that can tell causes apart override it."""
        record = self._read(key)
        return Fetched(key, None, MissCause.MISSING, "no such entry") if record is None else record

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
            self._tier_event("failed", entry.key, f"write to {self.name} failed")
            return False
        raw = entry.raw_bytes if entry.raw_bytes is not None else entry.size - entry.value_offset
        self.metrics.stored(raw, entry.size)
        self._tier_event("stored", entry.key)
        return True

    def _fits(self, info: EntryInfo) -> bool:
        if self.capacity is not None and info.size > self.capacity:
            log.warning(
                "%s: not storing %r: %d bytes exceed the capacity of %d", self.name, info.key, info.size, self.capacity
            )
            self.metrics.count("put_failures")
            self._tier_event("failed", info.key, f"larger than the capacity of {self.name}")
            return False
        return True

    def _tier_event(self, kind: str, key: str, reason: str = "") -> None:
        """Report what happened to ``key`` in this store as its own only tier (a stack reports its own moves)."""
        self.events.emit(StoreEvent(kind, key, None if kind == "failed" else self.name, reason))

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
        if self._delete(key):
            self._tier_event("evicted", key, f"damaged ({reason})")

    def _evicted(self, keys: list[str], freed: int) -> None:
        """Count and log the entries a write removed to stay within capacity."""
        if keys:
            self.metrics.count("evictions", len(keys))
            log.info("%s: evicted %d entries (%d bytes) to stay within a capacity of %s bytes",
                     self.name, len(keys), freed, self.capacity)
            for key in keys:
                self._tier_event("evicted", key, f"{self.name} full")
            if self.on_evicted is not None:
                self.on_evicted(keys, f"{self.name} full")
