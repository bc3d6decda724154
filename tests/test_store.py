"""The memory and file stores, URLs, the tiered store and its policies, prefix keys."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import sqlite3
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvtool.errors import UsageError
from kvtool.store import (
    CostAwarePolicy,
    LRUPolicy,
    PrefixKeyer,
    ReadOnlyStoreError,
    StoreClosedError,
    TieredStore,
    open_store,
    prefix_keys,
)
from kvtool.store.entry import wrap
from kvtool.store.file import FileStore
from kvtool.store.memory import MemoryStore
from kvtool.store.policy import Placement, TierProfile
from kvtool.testing import BoundedStoreTests, SharedStoreTests, StoreTests

KIB = 1024


class TestMemoryStore(BoundedStoreTests):
    @pytest.fixture
    def store(self):
        with MemoryStore(capacity=None) as store:
            yield store

    @pytest.fixture
    def capacity_store(self):
        with MemoryStore(capacity=self.CAPACITY) as store:
            yield store

    def test_a_pinned_entry_is_never_evicted_to_make_room(self, capacity_store):
        value = bytes(self.CAPACITY // 4 - 200)  # four records fill the store
        for key in "abcd":
            assert capacity_store.put(key, value)
        assert capacity_store.pin("a") and capacity_store.pin("b")
        for key in "efgh":
            assert capacity_store.put(key, value)  # c, d, then e, f leave: never a or b
        assert sorted(capacity_store.keys()) == ["a", "b", "g", "h"]
        assert capacity_store.pin("g") and capacity_store.pin("h")
        assert not capacity_store.put("i", value)  # only pinned entries could make its room
        assert sorted(capacity_store.keys()) == ["a", "b", "g", "h"]
        assert capacity_store.unpin("a") and capacity_store.put("i", value) and not capacity_store.contains("a")


class TestFileStore(BoundedStoreTests, SharedStoreTests):
    @pytest.fixture
    def store(self, tmp_path):
        with FileStore(tmp_path / "store") as store:
            yield store

    @pytest.fixture
    def capacity_store(self, tmp_path):
        with FileStore(tmp_path / "store", capacity=self.CAPACITY) as store:
            yield store

    @pytest.fixture
    def shared_url(self, tmp_path):
        url = f"file://{tmp_path}/store?capacity={self.SHARED_CAPACITY}"
        yield url
        with FileStore(tmp_path / "store") as store:  # after the processes: the files are the index's
            store.collect_garbage()
            assert sorted(p.name for p in (tmp_path / "store" / "entries").rglob("*") if p.is_file()) == sorted(
                store.path_of(key).name for key in store.keys())


class TestTieredStore(StoreTests):
    """A small memory tier over a file tier behaves like one store."""

    @pytest.fixture
    def store(self, tmp_path):
        with TieredStore([MemoryStore(capacity=16 * KIB), FileStore(tmp_path / "store")]) as store:
            yield store


class TestTieredStoreWritingBehind(StoreTests):
    """The same with write-behind: copies to the file tier in the background never change what a caller sees."""

    @pytest.fixture
    def store(self, tmp_path):
        with TieredStore([MemoryStore(capacity=16 * KIB), FileStore(tmp_path / "store")], write_behind=4) as store:
            yield store


# --- the file store ----------------------------------------------------------


def _value(i: int, size: int = 1000) -> bytes:
    return bytes([i % 251]) * size


def test_file_store_survives_reopening(tmp_path):
    with FileStore(tmp_path) as store:
        store.put("k", b"kept", {"tokens": 3})
    with FileStore(tmp_path) as store:
        assert store.get("k") == b"kept"
        assert store.info("k").tokens == 3


def test_file_store_recency_survives_reopening(tmp_path):
    record = len(wrap("a", _value(0)).record)
    with FileStore(tmp_path, capacity=3 * record) as store:
        for key in "abc":
            store.put(key, _value(0))
        assert store.get("a") is not None  # now the most recent
    with FileStore(tmp_path, capacity=3 * record) as store:
        store.put("d", _value(0))
        assert sorted(store.keys()) == ["a", "c", "d"]


def test_opening_with_a_smaller_capacity_evicts_nothing_until_a_write(tmp_path, caplog):
    record = len(wrap("k0", _value(0)).record)
    with FileStore(tmp_path) as store:
        for i in range(6):
            store.put(f"k{i}", _value(i))
    with FileStore(tmp_path, capacity=2 * record) as store:
        assert len(store.keys()) == 6 and store.used_bytes == 6 * record
        assert len(_record_files(tmp_path)) == 6
        assert store.get("k0") == _value(0)  # now the most recent
        with caplog.at_level(logging.INFO, logger="kvtool.store"):
            assert store.put("k6", _value(6))
        assert sorted(store.keys()) == ["k0", "k6"] and store.used_bytes == 2 * record
        assert store.stats()["evictions"] == 5
        assert "evicted 5 entries" in caplog.text
    assert len(_record_files(tmp_path)) == 2


def _record_files(root: Path) -> list[Path]:
    return sorted((root / "entries").rglob("*.kve"))


def test_two_processes_objects_share_one_directory(tmp_path):
    with FileStore(tmp_path / "store") as first, FileStore(tmp_path / "store") as second:
        assert stat.S_IMODE((tmp_path / "store").stat().st_mode) & 0o077 == 0
        assert stat.S_IMODE((tmp_path / "store" / "index.sqlite3").stat().st_mode) & 0o077 == 0
        assert first.put("k", b"from the first")
        assert second.get("k") == b"from the first"
        assert second.put("k", b"replaced by the second")
        assert first.get("k") == b"replaced by the second"
        assert second.delete("k") and first.get("k") is None
    assert _record_files(tmp_path / "store") == []


def test_a_read_only_store_changes_nothing(tmp_path, caplog):
    with FileStore(tmp_path) as store:
        store.put("a", _value(1))
        store.put("b", _value(2))
        damaged = store.path_of("b")
    damaged.write_bytes(damaged.read_bytes()[:-1])
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in _record_files(tmp_path)}
    with open_store(f"file://{tmp_path}", read_only=True) as store:
        assert store.keys() == ["a", "b"] and store.stats()["entries"] == 2
        assert store.get("a") == _value(1)
        with caplog.at_level(logging.WARNING, logger="kvtool.store"):
            assert store.get("b") is None
        assert "left in place" in caplog.text
        for write in (lambda: store.put("c", b"v"), lambda: store.delete("a"), store.collect_garbage):
            with pytest.raises(ReadOnlyStoreError, match="read-only"):
                write()
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in _record_files(tmp_path)} == before
    with FileStore(tmp_path, capacity=1) as store:  # the reads above did not count as uses
        assert store.keys() == ["a", "b"]


def test_garbage_of_crashed_writers_is_collected_and_nothing_else(tmp_path, caplog):
    with FileStore(tmp_path) as store:
        store.put("good", b"good value")
        store.put("gone", b"its file is removed")
        store.put("truncated", b"x" * 500)
        good, gone, truncated = (store.path_of(k) for k in ("good", "gone", "truncated"))
    gone.unlink()
    truncated.write_bytes(truncated.read_bytes()[:-10])
    digest = good.name[:40]
    orphan = good.with_name(f"{digest}-{'0' * 16}.kve")  # renamed, never indexed: a crash before commit
    orphan.write_bytes(good.read_bytes())
    stale = good.with_name(f".{digest}-{'1' * 16}.kve.part")
    stale.write_bytes(b"half a record")
    os.utime(stale, (1, 1))
    live = good.with_name(f".{digest}-{'2' * 16}.kve.part")  # a writer still at work holds its lock
    live.write_bytes(b"being written")
    os.utime(live, (1, 1))
    foreign = [tmp_path / "README", good.parent / "notes.txt", tmp_path / "entries" / "zz"]
    for path in foreign:
        path.write_text("not ours")
    with open(live, "rb") as held, FileStore(tmp_path) as store:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert orphan.exists() and stale.exists()  # opening changes nothing
        with caplog.at_level(logging.INFO, logger="kvtool.store"):
            assert store.collect_garbage() == {"partial": 1, "orphans": 1, "rows": 1, "skipped": 0}
            assert store.get("truncated") is None  # damaged records are found when read
        assert sorted(store.keys()) == ["good"]
        assert store.get("good") == b"good value"
    assert not orphan.exists() and not stale.exists() and not truncated.exists() and live.exists()
    assert all(path.exists() for path in foreign)
    assert "interrupted write" in caplog.text and "no index entry names" in caplog.text
    assert "length mismatch" in caplog.text


def test_the_first_write_of_a_process_collects_garbage(tmp_path):
    with FileStore(tmp_path) as store:
        store.put("a", b"1")
        stale = store.path_of("a").with_name(".%s-%s.kve.part" % ("0" * 40, "0" * 16))
    stale.write_bytes(b"half")
    os.utime(stale, (1, 1))
    with FileStore(tmp_path) as store:
        assert stale.exists()
        store.put("b", b"2")
        assert not stale.exists()


@pytest.mark.parametrize("key", ["../../../escape", "/etc/passwd", "..", "a/../../b", "C:\\x"])
def test_file_store_keys_stay_inside_the_directory(tmp_path, key):
    root = tmp_path / "store"
    with FileStore(root) as store:
        store.put(key, b"v")
        path = store.path_of(key)
        assert path.resolve().is_relative_to((root / "entries").resolve())
        assert store.get(key) == b"v"
    assert {p for p in tmp_path.rglob("*") if p.is_file()} <= {p for p in root.rglob("*")}


def test_file_store_write_failure_is_false_and_keeps_the_old_value(tmp_path, monkeypatch, caplog):
    with FileStore(tmp_path / "store") as store:
        assert store.put("k", b"old")

        def disk_full(fd):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "fsync", disk_full)
        with caplog.at_level(logging.WARNING, logger="kvtool.store"):
            assert not store.put("k", b"new")
        assert "cannot write" in caplog.text
        assert store.get("k") == b"old" and store.stats()["put_failures"] == 1
    assert not list((tmp_path / "store").rglob("*.part"))


def test_a_busy_index_fails_the_write_and_keeps_the_old_value(tmp_path, monkeypatch, caplog):
    with FileStore(tmp_path) as store:
        assert store.put("k", b"old")
        monkeypatch.setattr("kvtool.store.file.BUSY_TIMEOUT_S", 0.1)
        blocker = sqlite3.connect(tmp_path / "index.sqlite3", isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # another process in a long write transaction
        try:
            with FileStore(tmp_path) as other, caplog.at_level(logging.WARNING, logger="kvtool.store"):
                assert not other.put("k", b"new")
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert "not stored, any old value kept" in caplog.text
        assert store.get("k") == b"old"
    assert len(_record_files(tmp_path)) == 1


def test_a_forked_child_uses_its_own_index_connection(tmp_path):
    with FileStore(tmp_path) as store:
        store.put("parent", b"p")
        pid = os.fork()
        if pid == 0:  # the child: exit code 0 only if it reads and writes correctly
            ok = store.get("parent") == b"p" and store.put("child", b"c")
            os._exit(0 if ok else 1)
        assert os.waitpid(pid, 0)[1] == 0
        assert store.get("child") == b"c"


# --- URLs ------------------------------------------------------------------


def test_open_store_by_scheme(tmp_path, monkeypatch):
    with open_store("memory://?capacity=2MiB") as store:
        assert isinstance(store, MemoryStore) and store.capacity == 2 * 1024**2
    with open_store(f"file://{tmp_path}/abs?capacity=1KiB") as store:
        assert isinstance(store, FileStore) and store.root == tmp_path / "abs" and store.capacity == 1024
    monkeypatch.chdir(tmp_path)
    with open_store("file://./rel") as store:
        assert store.root == tmp_path / "rel"
    with open_store("file://plain") as store:
        assert store.root == tmp_path / "plain"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with open_store("file://~/kv") as store:
        assert store.root == tmp_path / "home" / "kv"


def test_open_store_builds_tiers_from_a_list(tmp_path):
    with open_store(f"memory://?capacity=1MiB, file://{tmp_path}") as store:
        assert isinstance(store, TieredStore)
        assert store.tier_names == ["memory", "file"]
    with open_store(f"file://{tmp_path}/a,file://{tmp_path}/b") as store:
        assert store.tier_names == ["file", "file2"]


@pytest.mark.parametrize(
    "url, message",
    [
        ("nonsense", "not a store URL"),
        ("ftp://host/x", "unknown store 'ftp'"),
        ("memory://?capacity=lots", "bad value for 'capacity'"),
        ("memory://?colour=blue", "unknown option 'colour'"),
        ("memory://somewhere", "has no location"),
        ("file://", "needs a path"),
        ("memory://,", "empty tier"),
        ("redis://:hunter2@127.0.0.1:1/0?colour=blue", "unknown option"),
    ],
)
def test_bad_urls_are_one_line_usage_errors(url, message):
    with pytest.raises(UsageError, match=message) as info:
        open_store(url)
    assert "\n" not in str(info.value)
    assert "hunter2" not in str(info.value)


def test_importing_stores_loads_no_redis():
    code = "import sys, kvtool.store, kvtool.cli; assert 'redis' not in sys.modules, 'redis imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the tiered store -----------------------------------------------------------


def _record_size(key: str = "k0", size: int = 1000, meta: dict | None = None) -> int:
    return len(wrap(key, b"\0" * size, meta or {}).record)


def _tiered(tmp_path, top: int = 2, middle: int = 2, **kwargs) -> TieredStore:
    """Memory over file, each holding ``top``/``middle`` entries of 1000 bytes (keys and metadata short)."""
    size = _record_size(key="k" * 8) + 40
    tiers = [MemoryStore(capacity=top * size), FileStore(tmp_path / "file", capacity=middle * size)]
    return TieredStore(tiers, **kwargs)


@pytest.fixture
def events():
    return []


def test_full_top_demotes_and_shared_bottom_evicts_by_itself(tmp_path, events):
    with _tiered(tmp_path) as store:
        store.subscribe(events.append)
        for i in range(5):
            assert store.put(f"k{i}", _value(i))
        assert [(e.kind, e.key, e.tier, e.reason) for e in events if e.kind != "stored"] == [
            ("demoted", "k0", "file", "memory full"),
            ("demoted", "k1", "file", "memory full"),
            ("evicted", "k0", "file", "file full"),  # the file tier made room itself, least recently used first
            ("demoted", "k2", "file", "memory full"),
        ]
        assert store.tiers[1].stats()["evictions"] == 1
        assert [store.tier_of(f"k{i}") for i in range(5)] == [None, "file", "file", "memory", "memory"]
        assert [store.tiers[1].get(f"k{i}") for i in (1, 2)] == [_value(1), _value(2)]
        assert [store.tiers[0].get(f"k{i}") for i in (3, 4)] == [_value(3), _value(4)]


def test_a_private_bottom_tier_evicts_and_counts_it(events, caplog):
    size = _record_size() + 40
    with TieredStore([MemoryStore(capacity=size), MemoryStore(capacity=2 * size)]) as store:
        store.subscribe(events.append)
        with caplog.at_level(logging.INFO, logger="kvtool.store"):
            for i in range(4):
                assert store.put(f"k{i}", _value(i))
        assert [(e.kind, e.key, e.tier, e.reason) for e in events if e.kind == "evicted"] == [
            ("evicted", "k0", "memory2", "bottom tier full")]
        assert store.stats()["tiers"][1]["evictions"] == 1 and store.stats()["tiers"][1]["deletes"] == 0
        assert "evicted 'k0' (bottom tier full)" in caplog.text


def test_a_failed_re_put_keeps_the_old_value(tmp_path):
    with _tiered(tmp_path) as store:
        assert store.put("k", _value(1))
        assert not store.put("k", b"\0" * 10_000)  # too big for every tier
        assert store.get("k") == _value(1)


def test_demoted_entry_keeps_its_bytes_and_metadata(tmp_path):
    with _tiered(tmp_path, top=1) as store:
        store.put("a", _value(1), {"tokens": 7})
        store.put("b", _value(2))
        assert store.tier_of("a") == "file"
        assert store.tiers[1].info("a").tokens == 7
        assert store.get("a") == _value(1)


def test_hit_below_is_promoted(tmp_path, events):
    with _tiered(tmp_path, top=1) as store:
        store.subscribe(events.append)
        store.put("a", _value(1))
        store.put("b", _value(2))
        assert store.tier_of("a") == "file"
        assert store.get("a") == _value(1)
        assert store.tier_of("a") == "memory" and store.tier_of("b") == "file"
        assert [(e.kind, e.tier, e.from_tier, e.reason) for e in events if e.key == "a"][-1] == (
            "promoted", "memory", "file", "hit")


def test_promotion_can_be_turned_off(tmp_path):
    with _tiered(tmp_path, top=1, promote=False) as store:
        store.put("a", _value(1))
        store.put("b", _value(2))
        assert store.get("a") == _value(1)
        assert store.tier_of("a") == "file"


def test_pinned_entries_are_never_demoted_or_evicted(tmp_path):
    with _tiered(tmp_path, top=1, middle=1) as store:
        store.put("pinned", _value(0))
        assert store.pin("pinned") and store.is_pinned("pinned")
        for i in range(4):
            assert store.put(f"k{i}", _value(i))  # lands below the pinned entry
        assert store.tier_of("pinned") == "memory"
        assert store.tier_of("k3") == "file"
        with pytest.raises(UsageError, match="pinned"):
            store.evict("pinned")
        with pytest.raises(UsageError, match="pinned"):
            store.offload("pinned", to="file")
        assert store.unpin("pinned") and not store.unpin("pinned") and not store.is_pinned("pinned")
        store.put("k9", _value(9))
        assert store.tier_of("pinned") == "file"


def test_a_pin_holds_in_a_shared_file_tier_that_makes_room_by_itself(tmp_path):
    """The file tier evicts by its own index, across processes: this process's pins are kept when it makes room."""
    with open_store(f"file://{tmp_path}/f?capacity=4KiB", policy=LRUPolicy()) as store:
        store.put("pinned", _value(0))
        assert store.pin("pinned")
        for i in range(1, 8):
            assert store.put(f"k{i}", _value(i))
        assert store.get("pinned") == _value(0) and not store.contains("k1")
        assert store.unpin("pinned")
        for i in range(8, 12):
            store.put(f"k{i}", _value(i))
        assert not store.contains("pinned")
        held = [key for key in store.keys()]
        assert all(store.pin(key) for key in held)
        assert not store.put("one-too-many", _value(99))  # no room beside the pinned entries: refused, none dropped
        assert sorted(store.keys()) == sorted(held)


def test_pin_unknown_key_is_false(tmp_path):
    with _tiered(tmp_path) as store:
        assert not store.pin("nothing")
        assert not store.touch("nothing")
        assert store.tier_of("nothing") is None


def test_touch_changes_who_leaves_first(tmp_path):
    with _tiered(tmp_path) as store:
        store.put("a", _value(1))
        store.put("b", _value(2))
        assert store.touch("a")
        store.put("c", _value(3))
        assert (store.tier_of("a"), store.tier_of("b")) == ("memory", "file")


def test_offload_and_prefetch(tmp_path, events):
    with _tiered(tmp_path) as store:
        store.subscribe(events.append)
        store.put("a", _value(1))
        assert store.offload("a", to="file")
        assert store.tier_of("a") == "file"
        assert store.offload("a", to=0) and store.tier_of("a") == "memory"
        assert store.offload("a") and store.tier_of("a") == "file"  # default: the bottom tier
        futures = store.prefetch(["a", "missing"])
        assert [f.result(timeout=10) for f in futures] == [True, False]
        assert store.tier_of("a") == "memory"
        assert [(e.kind, e.tier) for e in events if e.key == "a"] == [
            ("stored", "memory"), ("demoted", "file"), ("promoted", "memory"), ("demoted", "file"), ("promoted", "memory"),
        ]
        assert not store.offload("missing", to="file")
        with pytest.raises(UsageError, match="no tier"):
            store.offload("a", to="tape")
        with pytest.raises(UsageError, match="no tier"):
            store.offload("a", to=5)


def test_offload_to_a_tier_without_room_fails_with_an_event(tmp_path, events):
    with _tiered(tmp_path, top=1, middle=1) as store:
        store.subscribe(events.append)
        store.put("below", _value(1))
        store.put("top", _value(2))
        store.pin("top")
        assert not store.offload("below", to="memory")
        assert store.tier_of("below") == "file"
        assert events[-1].kind == "failed" and "no room" in events[-1].reason


def test_evict_and_delete_remove_from_every_tier(tmp_path, events):
    with _tiered(tmp_path, top=1) as store:
        store.subscribe(events.append)
        store.put("a", _value(1))
        store.put("b", _value(2))
        assert store.evict("a") and store.delete("b")
        assert not store.evict("a")
        assert store.keys() == [] and store.tiers[0].keys() == [] and store.tiers[1].keys() == []
        assert [(e.kind, e.reason) for e in events if e.kind == "evicted"] == [
            ("evicted", "evicted by caller"), ("evicted", "deleted")]


def test_entry_too_big_for_every_tier_is_refused(tmp_path, events):
    with _tiered(tmp_path) as store:
        store.subscribe(events.append)
        assert not store.put("huge", b"\0" * 10_000)
        assert not store.contains("huge")
        assert events[-1].kind == "failed"


def test_entry_too_big_for_the_top_lands_below(tmp_path):
    size = _record_size()
    tiers = [MemoryStore(capacity=size), FileStore(tmp_path, capacity=10 * size)]
    with TieredStore(tiers) as store:
        assert store.put("big", b"\0" * 3000)
        assert store.tier_of("big") == "file"


def test_damaged_entry_below_is_a_miss_with_an_event(tmp_path, events, caplog):
    with _tiered(tmp_path, top=1) as store:
        store.subscribe(events.append)
        store.put("a", _value(1))
        store.put("b", _value(2))
        path = store.tiers[1].path_of("a")
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        with caplog.at_level(logging.WARNING, logger="kvtool.store"):
            assert store.get("a") is None
        assert "checksum mismatch" in caplog.text
        assert ("evicted", "a") in [(e.kind, e.key) for e in events]
        assert not store.contains("a")


def test_subscribers_can_fail_and_unsubscribe(tmp_path, events):
    with _tiered(tmp_path) as store:
        def broken(event):
            raise RuntimeError("subscriber bug")

        store.subscribe(broken)
        unsubscribe = store.subscribe(events.append)
        assert store.put("a", b"1")
        unsubscribe()
        assert store.put("b", b"2")
        assert [e.key for e in events] == ["a"]


def test_tiered_store_reopens_from_its_persistent_tier(tmp_path):
    with _tiered(tmp_path, top=1) as store:
        store.put("a", _value(1))
        store.put("b", _value(2))  # a goes to file, b stays in memory
    with _tiered(tmp_path, top=1) as store:
        assert store.tier_of("a") == "file"
        assert store.tier_of("b") == "file"  # saved on close
        assert store.get("b") == _value(2)


def test_volatile_entries_are_dropped_on_close_if_asked(tmp_path):
    with _tiered(tmp_path, top=1, save_on_close=False) as store:
        store.put("a", _value(1))
    with _tiered(tmp_path, top=1) as store:
        assert store.keys() == []


def test_tiered_stats_report_each_tier(tmp_path):
    with _tiered(tmp_path, top=1) as store:
        store.put("a", _value(1), {"raw_bytes": 5000})
        store.put("b", _value(2))
        store.get("b")
        store.get("a")  # from the file tier
        store.get("absent")
        stats = json.loads(json.dumps(store.stats()))
    memory, file = stats["tiers"]
    assert (stats["hits"], stats["misses"]) == (2, 1)
    assert (memory["tier"], memory["hits"], file["tier"], file["hits"]) == ("memory", 1, "file", 1)
    # memory got a, b and a again (promoted); file got a and b (demoted)
    record_a, record_b = _record_size("a", meta={"raw_bytes": 5000}), _record_size("b")
    assert (memory["bytes_raw"], memory["bytes_stored"]) == (5000 + 1000 + 5000, 2 * record_a + record_b)
    assert (file["bytes_raw"], file["bytes_stored"]) == (5000 + 1000, record_a + record_b)
    assert stats["events"]["demoted"] >= 1 and stats["events"]["promoted"] == 1
    assert file["get_p99_ms"] >= file["get_p50_ms"] > 0
    assert stats["policy"] == "lru"


def test_tiered_store_is_thread_safe(tmp_path):
    errors = []

    def worker(seed: int, store: TieredStore) -> None:
        try:
            for i in range(60):
                key = f"k{(seed * 7 + i) % 12}"
                op = (seed + i) % 4
                if op == 0:
                    store.put(key, key.encode() * 100)
                elif op == 1:
                    value = store.get(key)
                    assert value is None or value == key.encode() * 100
                elif op == 2:
                    store.prefetch([key])[0].result(timeout=30)
                else:
                    store.offload(key, to="file")
        except Exception as exc:  # reported below
            errors.append(exc)

    with TieredStore([MemoryStore(capacity=2000), FileStore(tmp_path, capacity=5000)]) as store:
        threads = [threading.Thread(target=worker, args=(n, store)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert store.tiers[0].used_bytes <= 2000 and store.tiers[1].used_bytes <= 5000
        for key in store.keys():
            assert store.get(key) in (None, key.encode() * 100)


# --- write-behind -----------------------------------------------------------------


def _behind(tmp_path, top: int = 8, write_behind: int = 4) -> TieredStore:
    size = _record_size(key="k" * 8) + 40
    return TieredStore([MemoryStore(capacity=top * size), FileStore(tmp_path / "file")], write_behind=write_behind)


def test_memory_entries_reach_the_file_tier_and_stay_in_memory(tmp_path):
    with _behind(tmp_path) as store, FileStore(tmp_path / "file") as other_process:
        for i in range(5):
            assert store.put(f"k{i}", _value(i), {"tokens": i})
        store.flush()
        assert [store.tier_of(f"k{i}") for i in range(5)] == ["memory"] * 5
        assert [other_process.get(f"k{i}") for i in range(5)] == [_value(i) for i in range(5)]
        assert other_process.info("k3").tokens == 3
        behind = store.stats()["write_behind"]
        assert (behind["written"] + behind["written_by_caller"], behind["failed"], behind["queued"]) == (5, 0, 0)


def test_demoting_an_entry_with_its_copy_writes_nothing(tmp_path):
    with _behind(tmp_path, top=1) as store:
        store.put("a", _value(1))
        store.flush()
        store.put("b", _value(2))  # a leaves memory: its copy is already in the file tier
        store.flush()
        assert (store.tier_of("a"), store.tier_of("b")) == ("file", "memory")
        assert store.tiers[1].stats()["puts"] == 2
        assert store.get("a") == _value(1)


def test_re_put_and_delete_never_leave_an_old_copy_behind(tmp_path):
    with _behind(tmp_path) as store, FileStore(tmp_path / "file") as other_process:
        store.put("k", b"first")
        store.flush()
        store.put("k", b"second")
        assert other_process.get("k") in (None, b"second")
        store.flush()
        assert other_process.get("k") == b"second"
        assert store.delete("k")
        assert other_process.get("k") is None and store.get("k") is None


class _BlockingTier(MemoryStore):
    """A persistent tier whose writes wait until the test lets them through."""

    persistent = True

    def __init__(self) -> None:
        super().__init__(capacity=None, name="slow")
        self.open = threading.Event()

    def _stage(self, entry):
        self.open.wait(timeout=30)
        return super()._stage(entry)


def test_a_full_write_behind_queue_makes_put_wait(tmp_path):
    slow = _BlockingTier()
    with TieredStore([MemoryStore(capacity=None), slow], write_behind=2) as store:
        done = threading.Event()

        def put_four():
            for i in range(4):
                store.put(f"k{i}", _value(i))
            done.set()

        writer = threading.Thread(target=put_four)
        writer.start()
        assert not done.wait(timeout=0.5)  # k0 is being written, k1 and k2 queued: put(k3) writes k3 itself
        slow.open.set()
        writer.join(timeout=30)
        store.flush()
        assert done.is_set() and sorted(slow.keys()) == ["k0", "k1", "k2", "k3"]
        assert store.stats()["write_behind"]["written_by_caller"] == 1


KILLED_WRITER = """
import sys, time
from kvtool.store import TieredStore
from kvtool.store.file import FileStore
from kvtool.store.memory import MemoryStore

limit = int(sys.argv[2])
store = TieredStore([MemoryStore(capacity=None), FileStore(sys.argv[1])], write_behind=limit)
for i in range(40):
    store.put(f"k{i}", bytes([i]) * 200_000)
print("put all", flush=True)
time.sleep(600)
"""


def test_a_killed_process_loses_at_most_the_write_behind_queue(tmp_path):
    limit = 3
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path / "file"), str(limit)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "put all\n"
    finally:
        writer.kill()  # SIGKILL: no close, no flush
        writer.wait(timeout=30)
    with FileStore(tmp_path / "file") as store:
        keys = store.keys()
        assert len(keys) >= 40 - limit - 1  # the queue, and the one entry being written
        assert all(store.get(key) == bytes([int(key[1:])]) * 200_000 for key in keys)


def test_closed_tiered_store_refuses_scheduling(tmp_path):
    store = _tiered(tmp_path)
    store.close()
    calls = (lambda: store.pin("a"), lambda: store.offload("a"), lambda: store.prefetch(["a"]), lambda: store.tier_of("a"))
    for call in calls:
        with pytest.raises(StoreClosedError):
            call()


# --- policies --------------------------------------------------------------


def _placement(key: str, tokens: int | None, size: int = 1000, last_access: float = 0.0) -> Placement:
    return Placement(key, 0, size, tokens, last_access)


def test_lru_policy_orders_by_last_use():
    placements = [_placement("new", 1, last_access=5), _placement("old", 1, last_access=1)]
    assert [p.key for p in LRUPolicy().coldest_first(placements, TierProfile(0, 1e9), now=10)] == ["old", "new"]


def test_cost_aware_policy_admits_only_where_restoring_is_cheaper():
    policy = CostAwarePolicy(prefill_seconds_per_token=1e-3)
    fast, slow = TierProfile(1e-4, 1e9), TierProfile(0.5, 1e6)
    long_prefix, short_prefix = _placement("long", 10_000), _placement("short", 10)
    assert policy.admits(long_prefix, fast) and policy.admits(long_prefix, slow)
    assert policy.admits(short_prefix, fast) and not policy.admits(short_prefix, slow)
    assert policy.admits(_placement("unknown", None), slow)


def test_cost_aware_policy_gives_up_the_least_saving_per_byte_first():
    policy = CostAwarePolicy(prefill_seconds_per_token=1e-3, half_life_s=10)
    profile = TierProfile(1e-4, 1e9)
    placements = [
        _placement("valuable", 10_000, last_access=9),
        _placement("cheap", 50, last_access=9),
        _placement("big", 10_000, size=10**8, last_access=9),
        _placement("stale", 10_000, last_access=-1000),
        _placement("unknown", None, last_access=9),
    ]
    order = [p.key for p in policy.coldest_first(placements, profile, now=10)]
    assert order[0] == "unknown" and order[-1] == "valuable"
    assert order.index("stale") < order.index("valuable") and order.index("cheap") < order.index("valuable")


def test_cost_aware_policy_rejects_invalid_settings():
    with pytest.raises(UsageError):
        CostAwarePolicy(prefill_seconds_per_token=0)
    with pytest.raises(UsageError):
        CostAwarePolicy(prefill_seconds_per_token=1e-3, half_life_s=float("nan"))


class _SlowTier(MemoryStore):
    """A memory store that claims to restore slowly, standing in for a remote tier."""

    typical_latency_s = 0.5
    typical_bandwidth = 1e6


def test_cost_aware_tiered_store_keeps_entries_only_where_worth_it(tmp_path, events):
    size = _record_size(key="k" * 8, meta={"tokens": 10_000})
    tiers = [MemoryStore(capacity=2 * size, name="memory"), _SlowTier(capacity=None, name="slow")]
    with TieredStore(tiers, policy=CostAwarePolicy(prefill_seconds_per_token=1e-3)) as store:
        store.subscribe(events.append)
        store.put("long", _value(1), {"tokens": 10_000})  # saves 10 s per reuse
        store.put("short", _value(2), {"tokens": 10})  # saves 10 ms, slow tier costs 0.5 s
        store.put("new", _value(3), {"tokens": 10_000})  # the top is full: someone leaves
        assert store.tier_of("short") is None  # left first, and not worth keeping in the slow tier
        assert ("evicted", "short") in [(e.kind, e.key) for e in events]
        store.put("newer", _value(4), {"tokens": 10_000})
        assert store.tier_of("long") == "slow"  # worth keeping even there
        assert {store.tier_of("new"), store.tier_of("newer")} == {"memory"}


# --- prefix keys -----------------------------------------------------------


KEYER = PrefixKeyer("HuggingFaceTB/SmolLM2-135M", "channel-major|zstd:3", salt="tenant-a", chunk_tokens=4)


def test_prefix_keys_are_chained():
    tokens = list(range(100, 110))
    keys = KEYER.keys(tokens)
    assert len(keys) == 3  # 4 + 4 + 2
    assert KEYER.keys(tokens[:8]) == keys[:2]
    assert KEYER.keys(tokens[:9])[:2] == keys[:2] and KEYER.keys(tokens[:9])[2] != keys[2]
    changed = tokens.copy()
    changed[1] = 7
    assert all(a != b for a, b in zip(KEYER.keys(changed), keys))  # a change early changes every later key
    assert prefix_keys(tokens, 4, KEYER.model_id, KEYER.recipe, "tenant-a") == keys
    assert len(set(keys)) == 3 and all(len(k) == 64 for k in keys)


@pytest.mark.parametrize("field", ["model_id", "recipe", "salt"])
def test_prefix_keys_depend_on_model_recipe_and_tenant(field):
    tokens = list(range(12))
    other = PrefixKeyer(**{**KEYER.__dict__, field: getattr(KEYER, field) + "x"})
    assert not set(other.keys(tokens)) & set(KEYER.keys(tokens))


@pytest.mark.parametrize("tokens", [[-1], [2**32], [[1, 2]], [1.5]])
def test_prefix_keys_refuse_bad_tokens(tokens):
    with pytest.raises(UsageError):
        KEYER.keys(tokens)


def test_prefix_keyer_refuses_bad_chunks():
    with pytest.raises(UsageError):
        PrefixKeyer("m", "r", chunk_tokens=0)


def test_longest_cached_prefix_is_found():
    tokens = list(range(10))
    with MemoryStore() as store:
        chunks = [b"c0", b"c1", b"c2"]
        assert store.put_prefix(KEYER, tokens, chunks) == 3
        assert store.get_entry(KEYER.keys(tokens)[2]).meta == {"tokens": 2, "prefix_tokens": 10}
        hit = store.get_prefix(KEYER, tokens)
        assert (hit.values, hit.tokens) == (chunks, 10)
        longer = store.get_prefix(KEYER, tokens + [99, 98, 97])
        assert (longer.values, longer.tokens) == (chunks[:2], 8)
        diverging = store.get_prefix(KEYER, tokens[:5] + [0] * 5)
        assert (diverging.values, diverging.tokens) == (chunks[:1], 4)
        store.delete(KEYER.keys(tokens)[1])
        assert store.get_prefix(KEYER, tokens).tokens == 4  # a hole ends the prefix
        assert store.get_prefix(KEYER, []).tokens == 0


def test_tenants_never_hit_each_other():
    tokens = list(range(16))
    other_tenant = PrefixKeyer(KEYER.model_id, KEYER.recipe, salt="tenant-b", chunk_tokens=4)
    with MemoryStore() as store:
        store.put_prefix(KEYER, tokens, [b"a0", b"a1", b"a2", b"a3"])
        assert store.get_prefix(other_tenant, tokens).tokens == 0
        store.put_prefix(other_tenant, tokens, [b"b0"])
        assert store.get_prefix(other_tenant, tokens).values == [b"b0"]
        assert store.get_prefix(KEYER, tokens).values == [b"a0", b"a1", b"a2", b"a3"]


def test_put_prefix_stops_at_the_first_refused_chunk():
    tokens = list(range(12))
    with MemoryStore(capacity=_record_size(meta={"tokens": 4, "prefix_tokens": 4}) * 2) as store:
        chunks = [b"\0" * 1000, b"\0" * 10**6, b"\0" * 1000]
        assert store.put_prefix(KEYER, tokens, chunks) == 1
        with pytest.raises(UsageError):
            store.put_prefix(KEYER, tokens[:4], chunks)


def test_agent_session_example_runs(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "agent_session.py"
    result = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "memory -> file  offloaded by caller" in result.stdout
    assert "file -> memory  prefetched" in result.stdout
    assert "restored 256 of 296 tokens" in result.stdout
    assert "identical to the stored ones: True" in result.stdout


def test_agent_session_example_fails_in_one_line(tmp_path):
    """A bad store URL, or a Redis tier that does not answer, is one line and its exit code, never a
    traceback or a success reported over nothing restored."""
    import socket

    example = Path(__file__).resolve().parents[1] / "examples" / "agent_session.py"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for url, code, message in (("bogus://x", 2, "unknown store 'bogus'"),
                               (f"memory://,redis://127.0.0.1:{port}/0?timeout=0.5&connect_timeout=0.5", 3,
                                "cannot reach the redis store")):
        result = subprocess.run([sys.executable, str(example), "--store", url], capture_output=True, text=True,
                                timeout=120, cwd=tmp_path)
        assert result.returncode == code, result.stderr
        assert result.stderr.startswith(f"agent_session: error: {message}") and result.stderr.count("\n") == 1
        assert "identical" not in result.stdout


def test_tier_profile_follows_measurements():
    profile = TierProfile(latency_s=1e-3, bandwidth=1e9)
    for _ in range(50):
        profile.observe(1024, 0.010)  # small reads: latency
        profile.observe(100_000_000, 0.010 + 1.0)  # large reads: 100 MB/s after the latency
    assert profile.latency_s == pytest.approx(0.010, rel=0.01)
    assert profile.bandwidth == pytest.approx(1e8, rel=0.01)
    assert profile.restore_seconds(50_000_000) == pytest.approx(0.51, rel=0.02)
    assert json.loads(json.dumps(profile.to_dict()))["samples"] == 100


def test_entries_another_process_evicts_are_forgotten(tmp_path, events):
    with _tiered(tmp_path, top=1) as store, FileStore(tmp_path / "file") as other_process:
        store.subscribe(events.append)
        store.put("a", _value(1))
        store.put("b", _value(2))  # a: file
        assert other_process.delete("a")
        assert store.tier_of("a") is None and store.get("a") is None
        assert (events[-1].kind, events[-1].key, events[-1].reason) == ("evicted", "a", "gone from file")
