"""The file tier: one file per entry under a directory, shared by every process on the host.

Layout::

    ROOT/index.sqlite3 (-wal, -shm)        the index: key -> file, size, metadata, recency
    ROOT/entries/ab/ab12...ef-0123...cd.kve one record; BLAKE2b hash of the key, then a write id
    ROOT/entries/ab/.ab12...kve.part        a write in progress

Any number of processes (vLLM's scheduler and workers, several servers, the
CLI) open the same directory at once; no process holds it exclusively.
SQLite in WAL mode (Python's standard library) keeps the index: readers never
wait for writers, writers take turns in short transactions, and a process that
dies mid-transaction leaves the last committed state.

A write is published in three steps, so no reader ever sees part of an entry:

1. the record is written to a ``.part`` file under an exclusive ``flock``,
   fsynced, and renamed to its final, unique name (still locked);
2. one index transaction makes room (least recently used entries first, across
   every process's entries), points the key at the new file and commits;
3. the files the transaction unreferenced (the key's old record, evicted
   entries) are unlinked, then the lock is released.

A crash between any two steps leaves the index consistent: it only ever names
whole, synced files. What a crash can leave behind are files the index does not
name (a ``.part``, a renamed file whose commit never happened, an old record not
yet unlinked). ``collect_garbage`` removes them, and rows whose file is gone; it
recognises a live writer's files by their ``flock``, which dies with the
process. The first write of each process runs it. Opening never changes
anything, so inspecting a store (``kvtool store ls``) is always safe. The store
only opens regular files it owns, without blocking (``kvtool.store.owned_files``):
a FIFO, socket, device or link where an entry's file should be is a damaged
entry, and one named like a record or ``.part`` file is skipped by
``collect_garbage`` and reported. Opening with
``create=False`` (``open_store(..., create=False)``) also creates nothing where no store is.

A failed write (disk full, I/O error, the index busy beyond the timeout) returns
False and leaves the key's old value in place. Capacity is enforced by each
writer when it writes, with the capacity it opened the store with; opening
with a smaller capacity evicts nothing until the next write. Reads verify the
whole record's checksum; a reader racing a writer that replaces or evicts the
entry gets the new value or a miss. Recency of reads is recorded in the index in
batches (at the next write, or every second), so eviction order follows every
process's reads and survives restarts.

The directory must be on a local filesystem (SQLite's WAL needs shared memory
between the processes; NFS is not supported). Index commits use
``synchronous=NORMAL``: a killed process loses nothing committed, a power cut
may lose the last commits, whose files ``collect_garbage`` then removes.

URLs: everything between ``file://`` and ``?`` is a filesystem path:
``file:///var/cache/kvtool`` is absolute, ``file://./cache`` and
``file://cache`` are relative to the current directory when the store is
opened, ``file://~/kvtool`` is under the home directory. Options: ``capacity`` (``100GiB``; default unbounded).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import secrets
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import unquote

from kvtool.errors import MissingStoreError, UsageError
from kvtool.fileio import fsync_dir
from kvtool.store.base import StagedWrite, Store, log
from kvtool.store.entry import CorruptEntryError, Entry, EntryInfo, check_key, parse_info
from kvtool.store.file_index import INDEX, QUERY_BATCH, Failed, FileIndex, advance_clock, drop_coldest
from kvtool.store import file_gc
from kvtool.store.owned_files import read_exactly
from kvtool.store.owned_files import unlink as _unlink
from kvtool.store.results import Fetched, MissCause
from kvtool.store.url import parse_options, split_query
from kvtool.units import format_size, parse_size

__all__ = ["INDEX", "FileStore", "default_path"]

BUSY_TIMEOUT_S = 30.0  # how long a write waits for another process's transaction
TOUCH_FLUSH_S = 1.0  # recency of reads reaches the index at least this often
PART_GRACE_S = 2.0  # a .part file younger than this may belong to a writer about to lock it
_READ_ATTEMPTS = 3  # a read racing replacements of its key retries this often


def default_path() -> Path:
    """The file store kvtool uses unless told otherwise: ``$XDG_CACHE_HOME/kvtool/store`` (``~/.cache/...``)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "kvtool" / "store"


class FileStore(Store):
    """``file:///path?capacity=100GiB``: a directory of entries shared by every process on the host."""

    scheme = "file"
    persistent = True
    shared = True
    typical_latency_s = 1e-4
    typical_bandwidth = 2e9

    def __init__(
        self, path: str | os.PathLike[str], capacity: int | None = None, *, name: str | None = None, create: bool = True
    ) -> None:
        """``create=False`` opens only a store that exists, creating nothing: a directory that is not
        one (no index) is a ``MissingStoreError``."""
        super().__init__(capacity=capacity, name=name)
        self.root = Path(path).expanduser().absolute()
        self._entries = self.root / "entries"
        if not create and not (self.root / INDEX).is_file():
            there = "does not exist" if not self.root.exists() else "is not a file store (it has no index.sqlite3)"
            raise MissingStoreError(f"file store {self.root} {there}")
        try:  # KV caches reveal prompts: directories this store creates are private to the user
            if create:
                self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._entries.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot use {self.root} as a file store: {exc.strerror}") from None
        self._lock = threading.Lock()  # guards the reads not yet recorded in the index
        self._index = FileIndex(self.root, BUSY_TIMEOUT_S, self.name, functools.partial(self.metrics.count, "errors"),
                                create)
        self._touched: dict[str, None] = {}
        self._index.forked = self._forget_touches  # a forked child records only its own reads
        self._touch_flushed = time.monotonic()
        self._collected = False

    @classmethod
    def from_url(cls, url: str) -> "FileStore":
        return cls(_url_path(url), **parse_options(url, {"capacity": parse_size}))

    @classmethod
    def open_existing(cls, url: str) -> "FileStore":
        return cls(_url_path(url), **parse_options(url, {"capacity": parse_size}), create=False)

    def describe(self) -> str:
        capacity = "" if self.capacity is None else f"?capacity={format_size(self.capacity).replace(' ', '')}"
        return f"file://{self.root}{capacity}"

    @property
    def used_bytes(self) -> int:
        used: int = (self._index.row("SELECT bytes FROM totals") or (0,))[0]
        return used

    def path_of(self, key: str) -> Path | None:
        """The file that holds ``key``'s record now, or None."""
        check_key(key)
        row = self._index.row("SELECT file FROM entries WHERE key = ?", key)
        return None if row is None else self._entries / row[0]

    def stats(self) -> dict[str, Any]:
        """``compression_ratio`` is that of the entries held (with ``raw_bytes`` metadata), whoever wrote them."""
        data = super().stats()
        query = "SELECT SUM(raw_bytes), SUM(size) FROM entries WHERE raw_bytes IS NOT NULL"
        raw, size = self._index.query(lambda db: db.execute(query).fetchone(), (None, None))
        data["compression_ratio"] = raw / size if raw and size else None
        return data

    # --- hooks ----------------------------------------------------------------

    def _read(self, key: str) -> bytes | None:
        record = self._read_result(key)
        return record if isinstance(record, bytes) else None

    def _read_result(self, key: str) -> bytes | Fetched:
        previous = None
        for _ in range(_READ_ATTEMPTS):
            row = self._index.row_or_failed("SELECT file, size FROM entries WHERE key = ?", key)
            if isinstance(row, Failed):
                return Fetched(key, None, MissCause.UNREACHABLE, f"the index of {self.root} cannot be read")
            if row is None:
                return Fetched(key, None, MissCause.MISSING, "no such entry")
            name, size = row
            try:
                record = read_exactly(self._entries / name, size)
            except CorruptEntryError as exc:  # NotRegularFile too: a FIFO or device is never read
                self._drop_corrupt(key, exc)
                return Fetched(key, None, MissCause.DAMAGED, str(exc))
            except FileNotFoundError:
                if name == previous:  # not replaced meanwhile: the file is gone for good
                    log.warning("%s: the file of entry %r vanished; treated as a miss", self.name, key)
                    if not self.read_only:
                        self._delete(key)
                    return Fetched(key, None, MissCause.MISSING, "its file vanished")
                previous = name  # replaced or evicted since the lookup: look again
                continue
            except OSError as exc:
                log.warning("%s: cannot read entry %r (%s); treated as a miss", self.name, key, exc)
                self.metrics.count("errors")
                return Fetched(key, None, MissCause.UNREACHABLE, f"cannot read its file: {exc.strerror or exc}")
            if not self.read_only:
                self._touch(key)
            return record
        return Fetched(key, None, MissCause.MISSING, "replaced or evicted while it was read")

    def _write(self, info: EntryInfo, record: bytes) -> bool:
        staged = self._stage_record(info, record)
        return staged is not None and staged.commit()

    def _stage(self, entry: Entry) -> StagedWrite:
        staged = self._stage_record(entry, entry.record)
        if staged is None:
            return StagedWrite(lambda: False, lambda: None)
        return StagedWrite(staged.commit, staged.abort)

    def _delete(self, key: str) -> bool:
        def remove(db: sqlite3.Connection) -> str | None:
            row = db.execute("SELECT file, size FROM entries WHERE key = ?", (key,)).fetchone()
            if row is not None:
                db.execute("DELETE FROM entries WHERE key = ?", (key,))
                db.execute("UPDATE totals SET entries = entries - 1, bytes = bytes - ?", (row[1],))
            return None if row is None else row[0]

        name = self._index.transaction(remove, None)
        if name is not None:
            _unlink(self._entries / name)
        return name is not None

    def _contains(self, key: str) -> bool:
        return self._index.row("SELECT 1 FROM entries WHERE key = ?", key) is not None

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            check_key(key)
        self._check_open()
        found: set[str] = set()
        for start in range(0, len(keys), QUERY_BATCH):
            batch = list(keys[start:start + QUERY_BATCH])
            marks = ",".join("?" * len(batch))
            query = f"SELECT key FROM entries WHERE key IN ({marks})"
            none: list[tuple[str]] = []
            found.update(row[0] for row in self._index.query(functools.partial(_fetch_all, query=query, params=batch), none))
        return [key in found for key in keys]

    def _keys(self) -> list[str]:
        """Least recently used first."""
        return self._index.query(lambda db: [row[0] for row in db.execute("SELECT key FROM entries ORDER BY access")], [])

    def _count(self) -> int:
        count: int = (self._index.row("SELECT entries FROM totals") or (0,))[0]
        return count

    def _info(self, key: str) -> EntryInfo | None:
        row = self._index.row("SELECT size, meta FROM entries WHERE key = ?", key)
        return None if row is None else EntryInfo(key, row[0], json.loads(row[1]))

    def _close(self) -> None:
        if not self.read_only:
            with contextlib.suppress(sqlite3.Error):
                self._flush_touches()
        self._index.close()

    # --- garbage ----------------------------------------------------------------

    def collect_garbage(self) -> dict[str, int]:
        """Remove what crashed writers left: unnamed files, and index rows whose file is gone.

        Safe while other processes use the store (``kvtool.store.file_gc``). Returns counts of what was
        removed (``partial``, ``orphans``, ``rows``) and of special files skipped (``skipped``).
        """
        self._check_writable()
        removed = file_gc.collect(self._entries, self._index, self.name, PART_GRACE_S)
        self._collected = True
        return removed

    # --- writing ------------------------------------------------------------------

    def _stage_record(self, info: EntryInfo, record: bytes) -> "_Staged | None":
        """Write ``record`` to its final, unique file, locked and not yet in the index; None on failure."""
        if not self._collected:
            self.collect_garbage()
        digest = hashlib.blake2b(check_key(info.key), digest_size=20).hexdigest()
        name = f"{digest[:2]}/{digest}-{secrets.token_hex(8)}.kve"
        final = self._entries / name
        part = final.with_name(f".{final.name}.part")
        fd = -1
        try:
            final.parent.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)  # held until published: collect_garbage leaves it alone
            view = memoryview(record)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            os.rename(part, final)
            fsync_dir(final.parent)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
                _unlink(part)
            log.warning("%s: cannot write entry %r (%s); not stored, any old value kept", self.name, info.key, exc)
            self.metrics.count("errors")
            return None
        try:
            meta = parse_info(record, len(record)).meta
        except CorruptEntryError:  # a verbatim record (write_record): reads will judge it
            meta = info.meta
        return _Staged(self, info.key, name, len(record), meta, fd)

    def _publish(self, staged: "_Staged") -> bool:
        """The index transaction of a write: make room, name the new file, and unlink what it replaced."""
        raw = staged.meta.get("raw_bytes")
        raw = raw if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0 else None

        with self._pin_lock:
            pinned = set(self._pinned)  # this process's pins: kept when room is made

        def publish(db: sqlite3.Connection) -> tuple[list[str], list[str], int]:
            self._write_touches(db)
            clock = advance_clock(db)
            old = db.execute("SELECT file, size FROM entries WHERE key = ?", (staged.key,)).fetchone()
            entries, used = db.execute("SELECT entries, bytes FROM totals").fetchone()
            if old is not None:
                entries, used = entries - 1, used - old[1]
            victims, names, freed = drop_coldest(db, {staged.key, *pinned}, used + staged.size, self.capacity)
            if self.capacity is not None and used - freed + staged.size > self.capacity:
                raise _NoRoom  # the entries pinned here fill the room: rolled back, nothing dropped
            db.execute(
                "INSERT OR REPLACE INTO entries (key, file, size, raw_bytes, meta, access) VALUES (?, ?, ?, ?, ?, ?)",
                (staged.key, staged.name, staged.size, raw, json.dumps(staged.meta, sort_keys=True), clock),
            )
            db.execute("UPDATE totals SET entries = ?, bytes = ?",
                       (entries - len(victims) + 1, used - freed + staged.size))
            return victims, names + ([old[0]] if old is not None else []), freed

        try:
            result = self._index.transaction(publish, None)
        except _NoRoom:
            log.warning("%s: not storing %r: the entries pinned by this process fill the capacity", self.name,
                        staged.key)
            _unlink(self._entries / staged.name)
            return False
        if result is None:
            log.warning("%s: cannot index entry %r; not stored, any old value kept", self.name, staged.key)
            _unlink(self._entries / staged.name)
            return False
        victims, unreferenced, freed = result
        for name in unreferenced:
            _unlink(self._entries / name)
        self._evicted(victims, freed)
        return True

    # --- recency ------------------------------------------------------------------

    def _touch(self, key: str) -> None:
        """Record a read; reads reach the index with the next write or within ``TOUCH_FLUSH_S``."""
        with self._lock:
            self._touched.pop(key, None)  # (re-)insert at the end: the dict keeps read order
            self._touched[key] = None
            due = time.monotonic() - self._touch_flushed >= TOUCH_FLUSH_S
        if due:
            self._flush_touches()

    def _forget_touches(self) -> None:
        self._touched = {}

    def _flush_touches(self) -> None:
        self._index.transaction(self._write_touches, None)

    def _write_touches(self, db: sqlite3.Connection) -> None:
        """Make the keys read since the last flush the most recent entries, in the order they were read."""
        touched, self._touched = list(self._touched), {}
        self._touch_flushed = time.monotonic()
        if touched:
            first = advance_clock(db, len(touched)) - len(touched) + 1
            db.executemany("UPDATE entries SET access = ? WHERE key = ?",
                           [(first + i, key) for i, key in enumerate(touched)])


class _NoRoom(Exception):
    """A write that would not fit beside the entries this process pinned (raised inside the index transaction)."""


class _Staged:
    """A record in its final file, locked and not yet indexed."""

    def __init__(self, store: FileStore, key: str, name: str, size: int, meta: dict[str, Any], fd: int) -> None:
        self.store, self.key, self.name, self.size, self.meta, self._fd = store, key, name, size, meta, fd

    def commit(self) -> bool:
        try:
            return self.store._publish(self)
        finally:
            self._release()

    def abort(self) -> None:
        _unlink(self.store._entries / self.name)
        self._release()

    def _release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the flock
            self._fd = -1


def _url_path(url: str) -> str:
    base, _ = split_query(url)
    path = unquote(base.strip()[len("file://"):])
    if not path:
        raise UsageError("a file store URL needs a path: file:///var/cache/kvtool or file://./cache")
    return path


def _fetch_all(db: sqlite3.Connection, query: str, params: list[str]) -> list[tuple[str]]:
    return db.execute(query, params).fetchall()
