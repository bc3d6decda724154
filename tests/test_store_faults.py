"""Store faults that once hung, deleted or dropped entries: special files in a file store, an unreadable
index during garbage collection, bad Redis URLs, and closing a stack whose persistent tier is full."""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import tempfile
import threading
from pathlib import Path
from typing import Callable

import pytest

from kvtool.errors import UsageError
from kvtool.store import MissCause, StoreEvent, TieredStore, open_store
from kvtool.store.file import FileStore
from kvtool.store.memory import MemoryStore

DIGEST = "ab" + "0" * 38


def _within(seconds: float, fn: Callable[[], object], fifos: list[Path]) -> object:
    """``fn()``'s result, failing the test if it does not return within ``seconds`` (a hang on a FIFO)."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:  # let the stuck open() return, so the thread can end
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(5)
        pytest.fail(f"hung for more than {seconds}s opening a FIFO")
    return result[0]


def _replace_with(path: Path, kind: str, tmp_path: Path) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        target = tmp_path / "elsewhere"
        target.write_bytes(b"not a record of this store")
        path.symlink_to(target)
    else:
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.bind(str(path))
        except OSError as exc:  # the path may exceed the 108 bytes a socket address holds
            pytest.skip(f"cannot bind a socket at {len(str(path))} bytes: {exc}")
        finally:
            sock.close()


@pytest.mark.parametrize("kind", ["fifo", "symlink", "socket"])
def test_an_entry_file_that_is_not_a_regular_file_is_a_damaged_miss_without_blocking(tmp_path, kind, caplog):
    short = tempfile.TemporaryDirectory(dir="/tmp")  # a socket's path must fit in 108 bytes
    root = Path(short.name) / "s"
    with FileStore(root) as store:
        assert store.put("k", b"value")
        path = store.path_of("k")
        assert path is not None
        _replace_with(path, kind, tmp_path)
        with caplog.at_level(logging.WARNING, logger="kvtool.store"):
            fetched = _within(10, lambda: store.fetch("k"), [path])
        assert fetched.entry is None and fetched.cause is MissCause.DAMAGED  # type: ignore[attr-defined]
        assert "not a file of this store" in fetched.detail  # type: ignore[attr-defined]
        assert "damaged" in caplog.text
        assert store.get("k") is None and not store.contains("k")
        assert store.put("k", b"again") and store.get("k") == b"again"
    short.cleanup()


def test_fifos_named_like_record_or_part_files_are_skipped_by_garbage_collection(tmp_path, caplog):
    root = tmp_path / "s"
    with FileStore(root) as store:
        assert store.put("kept", b"value")
    shard = root / "entries" / "ab"
    shard.mkdir(exist_ok=True)
    fifos = [shard / f"{DIGEST}-{'1' * 16}.kve", shard / f".{DIGEST}-{'2' * 16}.kve.part"]
    for fifo in fifos:
        os.mkfifo(fifo)
        os.utime(fifo, (1, 1))  # old enough to look abandoned
    with FileStore(root) as store, caplog.at_level(logging.WARNING, logger="kvtool.store"):
        assert _within(10, lambda: store.put("new", b"v"), fifos)  # the first put collects garbage
        assert "skipping" in caplog.text and "a FIFO" in caplog.text
        counts = _within(10, store.collect_garbage, fifos)
        assert counts == {"partial": 0, "orphans": 0, "rows": 0, "skipped": 2}
        assert store.get("kept") == b"value" and store.get("new") == b"v"
    assert all(fifo.exists() for fifo in fifos)  # skipped, not opened and not removed


def test_garbage_collection_deletes_nothing_when_the_index_cannot_be_read(tmp_path, caplog):
    root = tmp_path / "s"
    with FileStore(root) as store:
        for i in range(3):
            assert store.put(f"k{i}", b"value %d" % i)
    records = sorted((root / "entries").rglob("*.kve"))
    assert len(records) == 3
    with FileStore(root) as store:
        db = store._index._connection()

        def deny_file_names(action: int, table: str | None, column: str | None, *_: object) -> int:
            reads_file = action == sqlite3.SQLITE_READ and (table, column) == ("entries", "file")
            return sqlite3.SQLITE_DENY if reads_file else sqlite3.SQLITE_OK

        db.set_authorizer(deny_file_names)  # every query naming the files now fails, as a locked index would
        with caplog.at_level(logging.WARNING, logger="kvtool.store"):
            assert store.collect_garbage() == {"partial": 0, "orphans": 0, "rows": 0, "skipped": 0}
        assert "garbage collection skipped" in caplog.text
        assert sorted((root / "entries").rglob("*.kve")) == records
        db.set_authorizer(None)
        assert [store.get(f"k{i}") for i in range(3)] == [b"value %d" % i for i in range(3)]


def test_a_file_read_that_cannot_ask_the_index_is_unreachable_not_missing(tmp_path):
    with FileStore(tmp_path / "s") as store:
        assert store.put("k", b"value")
        store._index._connection().set_authorizer(lambda *_: sqlite3.SQLITE_DENY)
        fetched = store.fetch("k")
        assert (fetched.entry, fetched.cause) == (None, MissCause.UNREACHABLE) and "index" in fetched.detail
        store._index._connection().set_authorizer(None)
        assert store.fetch("k").cause is None


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6390/x",
    "redis://127.0.0.1:6390/0/1",
    "redis://:secret@127.0.0.1:6390/db",
    "redis://127.0.0.1:6390/0?timeout=1e400",
    "redis://127.0.0.1:6390/0?connect_timeout=inf",
    "redis://127.0.0.1:6390/0?ttl=1e400",
    "redis://127.0.0.1:6390/0?backoff=nan",
    "redis+cluster://127.0.0.1:7000/?timeout=1e400",
])
def test_a_bad_redis_url_is_a_usage_error_at_open(url):
    pytest.importorskip("redis")
    with pytest.raises(UsageError) as raised:
        open_store(url)
    assert "\n" not in str(raised.value) and "secret" not in str(raised.value)


def test_a_redis_server_that_is_down_is_an_unreachable_miss():
    pytest.importorskip("redis")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once the socket is closed
    with open_store(f"redis://127.0.0.1:{port}/0?connect_timeout=0.2") as store:
        fetched = store.fetch("k")
        assert (fetched.key, fetched.entry, fetched.cause) == ("k", None, MissCause.UNREACHABLE)
        assert store.fetch("k").cause is MissCause.UNREACHABLE  # the breaker is open: still not "missing"


def test_closing_a_stack_whose_file_tier_cannot_take_its_memory_entries_reports_them_lost(tmp_path, caplog):
    events: list[StoreEvent] = []
    store = TieredStore([MemoryStore(capacity=1 << 20), FileStore(tmp_path / "s", capacity=2000)])
    store.subscribe(events.append)
    for i in range(3):
        assert store.put(f"big{i}", os.urandom(4000))  # fits memory, never the file tier
    assert store.put("small", b"s" * 100)
    with caplog.at_level(logging.WARNING, logger="kvtool.store"):
        store.close()
    assert sorted(store.lost_on_close) == ["big0", "big1", "big2"]
    assert "3 entries held only in memory were lost on close" in caplog.text
    lost = [e.key for e in events if e.kind == "evicted" and "lost on close" in e.reason]
    assert sorted(lost) == ["big0", "big1", "big2"]
    with FileStore(tmp_path / "s") as reopened:
        assert reopened.keys() == ["small"]


def test_a_stack_reports_the_gravest_cause_its_tiers_gave(tmp_path):
    pytest.importorskip("redis")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open_store(f"memory://,redis://127.0.0.1:{port}/0?connect_timeout=0.2") as store:
        assert store.fetch("k").cause is MissCause.UNREACHABLE  # not "missing": the bottom tier did not answer
    with open_store(f"memory://,file://{tmp_path / 's'}") as store:
        assert store.fetch("k").cause is MissCause.MISSING
        assert store.put("k", b"value") and store.offload("k", "file")
        record = bytearray(store.tiers[1].read_record("k") or b"")
        record[-1] ^= 0x01
        assert store.tiers[1].write_record("k", bytes(record))
        fetched = store.fetch("k")
        assert (fetched.entry, fetched.cause) == (None, MissCause.DAMAGED) and fetched.detail
