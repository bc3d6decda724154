"""The file tier: one file per entry under a directory, surviving restarts.

Layout::

    ROOT/.lock                      held (flock) by the one process using ROOT
    ROOT/entries/ab/ab12...ef.kve   one record; the name is a BLAKE2b hash of the key

A key never becomes part of a path, so no key can escape ROOT. Writes are
atomic (temp file, fsync, rename), so a crash leaves either the old record, the
new one, or a stray ``.part`` file. Opening the store rebuilds its index from
the files: ``.part`` files and records whose header does not match their size
or name are removed; full checksums are verified on every read. Recency is kept
in the files' modification times, so the least recently used entries are still
the first evicted after a restart, and the capacity is enforced on opening.

URLs: everything between ``file://`` and ``?`` is a filesystem path:
``file:///var/cache/kvtool`` is absolute, ``file://./cache`` and
``file://cache`` are relative to the current directory when the store is
opened, ``file://~/kvtool`` is under the home directory. Options: ``capacity`` (``100GiB``; default unbounded).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import threading
from pathlib import Path
from urllib.parse import unquote

from kvtool.errors import UsageError
from kvtool.fileio import atomic_write
from kvtool.store.base import Store, log
from kvtool.store.entry import HEADER, CorruptEntryError, EntryInfo, check_key, parse_head, parse_info
from kvtool.store.lru import LruSizes
from kvtool.store.url import parse_options, split_query
from kvtool.units import format_size, parse_size

_RECORD = re.compile(r"[0-9a-f]{40}\.kve")
_PARTIAL = re.compile(r"\.[0-9a-f]{40}\.kve\..+\.part")
_SHARD = re.compile(r"[0-9a-f]{2}")


class FileStore(Store):
    """``file:///path?capacity=100GiB``: one process at a time may open a directory."""

    scheme = "file"
    persistent = True
    typical_latency_s = 1e-4
    typical_bandwidth = 2e9

    def __init__(self, path: str | os.PathLike, capacity: int | None = None, *, name: str | None = None) -> None:
        super().__init__(capacity=capacity, name=name)
        self.root = Path(path).expanduser().absolute()
        self._entries = self.root / "entries"
        try:  # KV caches reveal prompts: directories this store creates are private to the user
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._entries.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot use {self.root} as a file store: {exc.strerror}") from None
        self._lock_file = open(self.root / ".lock", "a+b")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise UsageError(f"file store {self.root} is in use by another process") from None
        self._lock = threading.Lock()
        self._lru = LruSizes(capacity)
        self._rebuild_index()

    @classmethod
    def from_url(cls, url: str) -> "FileStore":
        base, _ = split_query(url)
        path = unquote(base.strip()[len("file://"):])
        if not path:
            raise UsageError("a file store URL needs a path: file:///var/cache/kvtool or file://./cache")
        return cls(path, **parse_options(url, {"capacity": parse_size}))

    def describe(self) -> str:
        capacity = "" if self.capacity is None else f"?capacity={format_size(self.capacity).replace(' ', '')}"
        return f"file://{self.root}{capacity}"

    @property
    def used_bytes(self) -> int:
        return self._lru.used

    def path_of(self, key: str) -> Path:
        """The file that holds ``key``'s record."""
        digest = hashlib.blake2b(check_key(key), digest_size=20).hexdigest()
        return self._entries / digest[:2] / f"{digest}.kve"

    # --- hooks ----------------------------------------------------------------

    def _read(self, key: str) -> bytes | None:
        with self._lock:
            if key not in self._lru:
                return None
            self._lru.touch(key)
        path = self.path_of(key)
        try:
            record = path.read_bytes()
            os.utime(path)  # recency survives a restart
        except FileNotFoundError:
            with self._lock:
                self._lru.remove(key)
            log.warning("%s: entry %r vanished from disk; treated as a miss", self.name, key)
            return None
        except OSError as exc:
            log.warning("%s: cannot read entry %r (%s); treated as a miss", self.name, key, exc)
            self.metrics.count("errors")
            return None
        return record

    def _write(self, info: EntryInfo, record: bytes) -> bool:
        # Room is made before writing, so a crash can leave the directory under
        # capacity but never over it (stray .part files are removed on opening).
        with self._lock:
            victims = self._lru.admit(info.key, len(record))
        self._unlink(victims)
        self._evicted(victims)
        path = self.path_of(info.key)
        try:
            path.parent.mkdir(exist_ok=True)
            with atomic_write(path) as f:
                f.write(record)
        except OSError as exc:
            with self._lock:
                self._lru.remove(info.key)
            with contextlib.suppress(OSError):
                path.unlink()
            log.warning("%s: cannot write entry %r (%s); not stored", self.name, info.key, exc)
            self.metrics.count("errors")
            return False
        return True

    def _delete(self, key: str) -> bool:
        with self._lock:
            known = self._lru.remove(key)
        self._unlink([key])
        return known

    def _contains(self, key: str) -> bool:
        with self._lock:
            return key in self._lru

    def _keys(self) -> list[str]:
        with self._lock:
            return self._lru.keys()

    def _info(self, key: str) -> EntryInfo | None:
        with self._lock:
            if key not in self._lru:
                return None
        try:
            return _read_info(self.path_of(key))
        except FileNotFoundError:
            return None

    def _close(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
        self._lock_file.close()

    # --- helpers --------------------------------------------------------------

    def _unlink(self, keys: list[str]) -> None:
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                self.path_of(key).unlink()

    def _rebuild_index(self) -> None:
        found: list[tuple[float, str, int]] = []
        for shard in self._entries.iterdir():
            if not (_SHARD.fullmatch(shard.name) and shard.is_dir()):
                continue
            for path in shard.iterdir():
                if _PARTIAL.fullmatch(path.name):
                    log.info("%s: removing incomplete write %s", self.name, path.name)
                    _remove(path)
                elif _RECORD.fullmatch(path.name):
                    entry = self._check_file(path)
                    if entry is not None:
                        found.append(entry)
        victims = []
        for _, key, record_size in sorted(found):
            victims += self._lru.admit(key, record_size)
        victims += self._lru.shrink()
        self._unlink(victims)
        self._evicted(victims)

    def _check_file(self, path: Path) -> tuple[float, str, int] | None:
        """``(mtime, key, size)`` of a record file whose header is sound; removes it otherwise."""
        try:
            stat = path.stat()
            info = _read_info(path)
            if self.path_of(info.key) != path:
                raise CorruptEntryError("record is not in the file its key maps to")
        except (CorruptEntryError, UsageError) as exc:
            log.warning("%s: removing damaged entry file %s: %s", self.name, path.name, exc)
            _remove(path)
            return None
        except OSError as exc:
            log.warning("%s: skipping unreadable entry file %s: %s", self.name, path.name, exc)
            return None
        return stat.st_mtime, info.key, stat.st_size


def _read_info(path: Path) -> EntryInfo:
    with open(path, "rb") as f:
        record_size = os.fstat(f.fileno()).st_size
        head = f.read(HEADER.size)
        key_len, meta_len, _ = parse_head(head, record_size)
        return parse_info(head + f.read(key_len + meta_len), record_size)


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
