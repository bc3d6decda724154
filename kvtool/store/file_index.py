"""The file store's index: one SQLite database in WAL mode, shared by every process that opens the store.

``FileIndex`` holds this process's connection (a forked child opens its own)
and runs queries and write transactions on it, one thread at a time. A
failed query or transaction is logged and answered with the caller's
``on_failure`` value, so a caller that must tell "nothing found" from "could
not ask" passes a value no query returns (``FAILED``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

from kvtool.errors import MissingStoreError, UsageError

T = TypeVar("T")

log = logging.getLogger("kvtool.store")

INDEX = "index.sqlite3"
SCHEMA_VERSION = 1
QUERY_BATCH = 500  # keys per IN (...) query

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    file TEXT NOT NULL UNIQUE,   -- path under entries/
    size INTEGER NOT NULL,       -- bytes of the record
    raw_bytes INTEGER,           -- uncompressed KV bytes, from the metadata
    meta TEXT NOT NULL,          -- the record's metadata, JSON
    access INTEGER NOT NULL      -- the store's clock at the last write or read: LRU order
);
CREATE INDEX IF NOT EXISTS entries_by_access ON entries(access);
CREATE TABLE IF NOT EXISTS totals (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    entries INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    clock INTEGER NOT NULL
);
INSERT OR IGNORE INTO totals VALUES (0, 0, 0, 0);
"""


class Failed:
    """The type of ``FAILED``: what a query answers when the index could not be read."""

    def __repr__(self) -> str:
        return "FAILED"


FAILED = Failed()


class FileIndex:
    """The index of the store at ``root``: connection, queries and transactions."""

    def __init__(self, root: Path, busy_timeout_s: float, owner: str, on_error: Callable[[], None],
                 create: bool = True) -> None:
        self.root = root
        self.create = create  # False: open an existing index as it is, never create or upgrade one
        self.busy_timeout_s = busy_timeout_s
        self.owner = owner  # the store's name, for log messages
        self._on_error = on_error  # counts a failure in the store's metrics
        self.lock = threading.Lock()  # one connection, used by one thread at a time
        self._pid = os.getpid()
        self._db = self._connect()
        self.forked: Callable[[], None] = lambda: None  # called in a forked child before its first query

    def row(self, query: str, *params: Any) -> tuple[Any, ...] | None:
        """The first row of a query; None if there is none or the index cannot be read (logged)."""
        first: tuple[Any, ...] | None = self.query(lambda db: db.execute(query, params).fetchone(), None)
        return first

    def row_or_failed(self, query: str, *params: Any) -> tuple[Any, ...] | None | Failed:
        """The first row of a query, None if there is none, ``FAILED`` if the index cannot be read."""
        return self.query_or_failed(lambda db: db.execute(query, params).fetchone())

    def query(self, fn: Callable[[sqlite3.Connection], T], on_failure: T) -> T:
        result = self.query_or_failed(fn)
        return on_failure if isinstance(result, Failed) else result

    def query_or_failed(self, fn: Callable[[sqlite3.Connection], T]) -> T | Failed:
        """``fn``'s answer, or ``FAILED`` (logged and counted) when the index cannot be read."""
        with self.lock:
            try:
                return fn(self._connection())
            except sqlite3.Error as exc:
                log.warning("%s: index query failed (%s)", self.owner, exc)
                self._on_error()
                return FAILED

    def transaction(self, fn: Callable[[sqlite3.Connection], T], on_failure: T) -> T:
        """Run ``fn`` in one write transaction (other writers wait up to the busy timeout)."""
        with self.lock:
            db = self._connection()
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    result = fn(db)
                    db.execute("COMMIT")
                    return result
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                log.warning("%s: index update failed (%s)", self.owner, exc)
                self._on_error()
                return on_failure

    def close(self) -> None:
        with self.lock:
            if self._pid == os.getpid():
                self._db.close()

    def _connect(self) -> sqlite3.Connection:
        path = self.root / INDEX
        try:  # an existing store's index is opened as it is: mode=rw never creates the file
            target, uri = (str(path), False) if self.create else (f"{path.as_uri()}?mode=rw", True)
            db = sqlite3.connect(target, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False,
                                 uri=uri)
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                db.close()
                raise UsageError(f"file store {self.root} was made by a newer kvtool (index version too new)")
            if not self.create and version < SCHEMA_VERSION:
                db.close()
                raise MissingStoreError(f"file store {self.root} is not a file store (its index.sqlite3 holds no index)")
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")
            if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")
        except sqlite3.Error as exc:
            raise UsageError(f"cannot open the index of file store {self.root}: {exc}") from None
        with contextlib.suppress(OSError):
            os.chmod(path, 0o600)
        return db

    def _connection(self) -> sqlite3.Connection:
        """The connection; a forked child opens its own (SQLite connections must not cross a fork)."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._db = self._connect()
            self.forked()
        return self._db


def advance_clock(db: sqlite3.Connection, ticks: int = 1) -> int:
    """Advance the store's clock by ``ticks``; its new value."""
    clock: int = db.execute("UPDATE totals SET clock = clock + ? RETURNING clock", (ticks,)).fetchone()[0]
    return clock


def drop_coldest(db: sqlite3.Connection, keep: set[str], need: int,
                 capacity: int | None) -> tuple[list[str], list[str], int]:
    """Delete the least recently used rows (never those of ``keep``) until ``need`` bytes of use fit ``capacity``.

    Returns the keys dropped, their files (for the caller to unlink after the commit) and the bytes freed.
    """
    victims: list[str] = []
    names: list[str] = []
    freed = 0
    if capacity is None or need <= capacity:
        return victims, names, freed
    rows = db.execute("SELECT key, file, size FROM entries ORDER BY access")
    for key, name, size in rows:
        if need - freed <= capacity:
            break
        if key in keep:
            continue
        victims.append(key)
        names.append(name)
        freed += size
    rows.close()
    for start in range(0, len(victims), QUERY_BATCH):
        batch = victims[start:start + QUERY_BATCH]
        db.execute(f"DELETE FROM entries WHERE key IN ({','.join('?' * len(batch))})", batch)
    return victims, names, freed
