"""``StoreTests``: the conformance suite for a store.

Subclasses provide a ``store`` fixture (an empty store, closed by the fixture
after the test); a backend with a byte capacity of its own subclasses
``BoundedStoreTests`` and also provides a ``capacity_store`` holding at most
``CAPACITY`` bytes; a backend that several processes share subclasses
``SharedStoreTests`` and provides ``shared_url``. The suite checks round trips,
overwrite, empty and large values, metadata, batch calls, key checks, that a
damaged stored value is a logged miss and never wrong bytes, that ``fetch`` says
why a read missed (missing, damaged), the tier calls every store speaks (a plain
store as a one-tier stack: pin, offload, prefetch, evict, events), capacity and LRU
eviction, that a refused re-put keeps the old value, closed-store errors,
JSON-safe stats, a Hypothesis state machine comparing the store with a dict, and
several processes working on one store at once.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, ClassVar, cast

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvtool.errors import UsageError
from kvtool.store import MissCause, Store, StoreClosedError, StoreEvent
from kvtool.testing.shared import check_shared, run_mix, run_processes

KEYS = ["a", "b", "model/7:chunk-0", "ключ", "k" * 300]


def _record_of(store: Store, key: str) -> bytes:
    record = store.read_record(key)
    assert record is not None, f"no record for {key!r}"
    return record


def _payload(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


class _DictModel(RuleBasedStateMachine):
    """Every operation on the store must agree with the same operation on a dict."""

    def __init__(self, store: Store):
        super().__init__()
        self.store = store
        for key in store.keys():
            store.delete(key)
        self.model: dict[str, bytes] = {}

    @rule(key=st.sampled_from(KEYS), value=st.binary(max_size=2048))
    def put(self, key, value):
        assert self.store.put(key, value)
        self.model[key] = value

    @rule(key=st.sampled_from(KEYS))
    def get(self, key):
        assert self.store.get(key) == self.model.get(key)

    @rule(key=st.sampled_from(KEYS))
    def fetch(self, key: str) -> None:
        fetched = self.store.fetch(key)
        assert fetched.key == key
        if key in self.model:
            assert fetched.entry is not None and fetched.cause is None
            assert bytes(fetched.entry.value) == self.model[key]
        else:
            assert fetched.entry is None and fetched.cause is MissCause.MISSING

    @rule(key=st.sampled_from(KEYS))
    def contains(self, key):
        assert self.store.contains(key) == (key in self.model)

    @rule(key=st.sampled_from(KEYS))
    def delete(self, key):
        assert self.store.delete(key) == (key in self.model)
        self.model.pop(key, None)

    @invariant()
    def same_keys(self):
        assert sorted(self.store.keys()) == sorted(self.model)


class StoreTests:
    """Base class; subclasses define a ``store`` fixture."""

    @pytest.fixture
    def store(self) -> Store:  # pragma: no cover - replaced by subclasses
        raise NotImplementedError("subclasses of StoreTests provide a `store` fixture")


    # --- round trips --------------------------------------------------------

    def test_put_get(self, store: Store):
        assert store.put("k", b"value")
        assert store.get("k") == b"value"
        assert store.contains("k")

    def test_missing_key(self, store: Store):
        assert store.get("absent") is None
        assert store.get_entry("absent") is None
        assert store.info("absent") is None
        assert not store.contains("absent")
        assert not store.delete("absent")

    def test_overwrite(self, store: Store):
        store.put("k", b"first")
        store.put("k", b"second, longer")
        assert store.get("k") == b"second, longer"
        assert store.keys().count("k") == 1

    def test_empty_value(self, store: Store):
        assert store.put("empty", b"")
        assert store.get("empty") == b""
        assert store.contains("empty")

    def test_large_value(self, store: Store):
        value = _payload(3 * 1024 * 1024 + 7)
        assert store.put("large", value)
        assert store.get("large") == value

    @pytest.mark.parametrize("kind", ["bytearray", "memoryview", "numpy-u16"])
    def test_bytes_like_values(self, store: Store, kind):
        value = _payload(1000)
        makers: dict[str, Callable[[bytes], Any]] = {"bytearray": bytearray, "memoryview": memoryview,
                                                     "numpy-u16": lambda v: np.frombuffer(v, dtype=np.uint16)}
        buffer = makers[kind](value)
        assert store.put("k", buffer)
        assert store.get("k") == value

    def test_non_buffer_values_are_refused(self, store: Store):
        with pytest.raises(UsageError):
            store.put("k", cast(Any, "text"))  # not a buffer: the type a caller might wrongly pass
        with pytest.raises(UsageError):
            store.put("k", cast(Any, np.zeros((4, 4), dtype=np.uint8)[:, ::2]))  # not contiguous

    def test_metadata(self, store: Store):
        store.put("k", b"v" * 10, {"tokens": 5, "raw_bytes": 100, "note": "x"})
        entry = store.get_entry("k")
        assert entry is not None
        assert entry.meta == {"tokens": 5, "raw_bytes": 100, "note": "x"}
        assert bytes(entry.value) == b"v" * 10
        info = store.info("k")
        assert info is not None
        assert (info.tokens, info.raw_bytes, info.size) == (5, 100, entry.size)

    def test_keys_and_delete(self, store: Store):
        for key in KEYS:
            store.put(key, key.encode())
        assert sorted(store.keys()) == sorted(KEYS)
        assert store.delete("a")
        assert not store.contains("a") and store.get("a") is None
        assert sorted(store.keys()) == sorted(k for k in KEYS if k != "a")

    def test_batch_calls(self, store: Store):
        assert store.put_many({"x": b"1", "y": b"2"}) == [True, True]
        assert store.get_many(["x", "nope", "y"]) == [b"1", None, b"2"]
        assert store.contains_many(["x", "nope"]) == [True, False]

    @pytest.mark.parametrize("key", ["", "line\nbreak", "nul\x00", "k" * 1025, 7, b"bytes", "lone \ud800 surrogate"])
    def test_invalid_keys_are_refused(self, store: Store, key):
        with pytest.raises(UsageError):
            store.put(key, b"v")
        with pytest.raises(UsageError):
            store.get(key)

    def test_lone_surrogate_key_error_says_why(self, store: Store):
        with pytest.raises(UsageError, match="lone surrogate '\\\\udc80' at position 3"):
            store.put("bad\udc80key", b"v")
        assert store.keys() == []

    def test_metadata_must_be_json(self, store: Store):
        with pytest.raises(UsageError):
            store.put("k", b"v", {"bad": object()})
        assert not store.contains("k")

    def test_fetch_says_hit_or_missing(self, store: Store):
        store.put("k", b"value", {"tokens": 3})
        fetched = store.fetch("k")
        assert fetched.entry is not None and bytes(fetched.entry.value) == b"value"
        assert (fetched.key, fetched.cause, fetched.entry.tokens) == ("k", None, 3)
        assert fetched.tier in store.tier_names and fetched.tier == store.tier_of("k")
        absent = store.fetch("absent")
        assert (absent.key, absent.entry, absent.cause, absent.tier) == ("absent", None, MissCause.MISSING, None)
        assert absent.cause == "missing" and absent.detail

    # --- tiers: every store is a stack of one or more -------------------------

    def test_every_store_speaks_tiers(self, store: Store):
        events: list[StoreEvent] = []
        unsubscribe = store.subscribe(events.append)
        assert len(store.tiers) == len(store.tier_names) >= 1
        assert store.put("k", b"value")
        assert [(e.kind, e.key) for e in events] == [("stored", "k")]
        assert events[0].tier in store.tier_names
        assert store.tier_of("k") in store.tier_names and store.tier_of("absent") is None
        assert [f.result(timeout=30) for f in store.prefetch(["k", "absent"])] == [True, False]
        assert store.touch("k") and not store.touch("absent")
        assert store.pin("k") and not store.pin("absent") and store.is_pinned("k")
        for refused in (lambda: store.evict("k"), lambda: store.offload("k", 0)):
            with pytest.raises(UsageError, match="pinned"):
                refused()
        with pytest.raises(UsageError, match="no tier"):
            store.offload("k", "no such tier")
        assert store.unpin("k") and not store.unpin("k")
        assert store.offload("k", store.tier_names[-1]) and store.tier_of("k") == store.tier_names[-1]
        store.flush()
        assert store.evict("k") and not store.evict("k") and store.tier_of("k") is None
        assert events[-1].kind == "evicted" and events[-1].key == "k"
        unsubscribe()
        store.put("other", b"v")
        assert all(e.key == "k" for e in events)

    def test_batch_puts_are_reported_as_events(self, store: Store):
        events: list[StoreEvent] = []
        store.subscribe(events.append)
        assert store.put_many({"x": b"1", "y": b"2"}) == [True, True]
        assert sorted((e.kind, e.key) for e in events) == [("stored", "x"), ("stored", "y")]

    # --- integrity ----------------------------------------------------------

    @pytest.mark.parametrize("damage", ["flip-value", "flip-header", "truncate", "extend", "garbage"])
    def test_damaged_value_is_a_logged_miss(self, store: Store, damage, caplog):
        value = _payload(5000, seed=3)
        store.put("k", value)
        record = bytearray(_record_of(store, "k"))
        if damage == "flip-value":
            record[-100] ^= 0x10
        elif damage == "flip-header":
            record[12] ^= 0x01
        elif damage == "truncate":
            record = record[:-1]
        elif damage == "extend":
            record += b"\0"
        else:
            record = bytearray(b"not a record")
        assert store.write_record("k", bytes(record))
        with caplog.at_level(logging.WARNING, logger="kvtool.store"):
            assert store.get("k") is None
        assert "damaged" in caplog.text
        assert store.get("k") is None
        assert store.write_record("k", bytes(record))
        fetched = store.fetch("k")
        assert (fetched.key, fetched.entry, fetched.cause) == ("k", None, MissCause.DAMAGED) and fetched.detail
        assert store.fetch("k").cause is MissCause.MISSING  # a damaged entry is dropped

    def test_a_value_checked_by_its_reader_is_not_hashed_twice(self, store: Store, caplog):
        """``fetch(check_value=False)`` parses the record but leaves the value to a reader that checks it (a .kvz
        checks every chunk): a flipped value byte comes back as it is, and ``drop_damaged`` then drops it."""
        value = _payload(5000, seed=4)
        store.put("k", value, {"tokens": 7})
        record = bytearray(_record_of(store, "k"))
        record[-100] ^= 0x10
        assert store.write_record("k", bytes(record))
        fetched = store.fetch("k", check_value=False)
        assert fetched.entry is not None and fetched.tier in store.tier_names and fetched.entry.tokens == 7
        assert bytes(fetched.entry.value) != value and len(fetched.entry.value) == len(value)
        with caplog.at_level(logging.WARNING, logger="kvtool.store"):
            store.drop_damaged("k", "chunk 3 does not match its checksum")
        assert "chunk 3 does not match its checksum" in caplog.text
        assert store.fetch("k").cause is MissCause.MISSING
        store.write_record("k", b"not a record")  # a broken frame is still refused
        assert store.fetch("k", check_value=False).cause is MissCause.DAMAGED

    def test_record_of_another_key_is_a_miss(self, store: Store, caplog):
        store.put("a", b"value of a")
        store.write_record("b", _record_of(store, "a"))
        with caplog.at_level(logging.WARNING, logger="kvtool.store"):
            assert store.get("b") is None
        assert "another key" in caplog.text
        assert store.get("a") == b"value of a"

    def test_read_only_reads_and_changes_nothing(self, store: Store, caplog):
        store.put("k", b"value")
        record = bytearray(_record_of(store, "k"))
        record[-1] ^= 0x01
        store.write_record("damaged", bytes(record))
        store.read_only = True
        assert store.get("k") == b"value" and store.keys().count("k") == 1
        for write in (lambda: store.put("k", b"new"), lambda: store.delete("k"),
                      lambda: store.write_record("k", b"x")):
            with pytest.raises(UsageError, match="read-only"):
                write()
        with caplog.at_level(logging.WARNING, logger="kvtool.store"):
            assert store.get("damaged") is None
        assert "left in place" in caplog.text
        store.read_only = False
        assert store.read_record("damaged") == bytes(record)
        assert store.get("k") == b"value"

    # --- lifecycle and reporting --------------------------------------------

    def test_closed_store_raises(self, store: Store):
        store.put("k", b"v")
        store.close()
        assert store.closed
        for call in (lambda: store.get("k"), lambda: store.put("k", b"v"), lambda: store.contains("k"),
                     lambda: store.delete("k"), store.keys, store.stats):
            with pytest.raises(StoreClosedError):
                call()
        store.close()  # idempotent

    def test_context_manager_closes(self, store: Store):
        with store as same:
            assert same is store
        assert store.closed

    def test_stats_are_json_safe(self, store: Store):
        store.put("k", b"v")
        store.get("k")
        store.get("absent")
        stats = json.loads(json.dumps(store.stats()))
        assert stats["hits"] >= 1 and stats["misses"] >= 1
        assert stats["entries"] == 1
        assert stats["get_p50_ms"] is not None and stats["get_p99_ms"] >= stats["get_p50_ms"]

    def test_repr_names_the_store(self, store: Store):
        assert store.describe() in repr(store)

    def test_behaves_like_a_dict(self, store: Store):
        run_state_machine_as_test(
            lambda: _DictModel(store),
            settings=settings(max_examples=25, stateful_step_count=15, deadline=None),
        )


class BoundedStoreTests(StoreTests):
    """``StoreTests`` plus capacity and LRU eviction, for a backend that bounds its own bytes.

    Subclasses also define a ``capacity_store`` fixture holding at most ``CAPACITY`` bytes.
    """

    CAPACITY = 64 * 1024

    @pytest.fixture
    def capacity_store(self) -> Store:  # pragma: no cover - replaced by subclasses
        raise NotImplementedError("subclasses of BoundedStoreTests provide a `capacity_store` fixture")

    def test_capacity_is_never_exceeded(self, capacity_store: Store):
        value = _payload(self.CAPACITY // 5)
        for i in range(20):
            assert capacity_store.put(f"k{i}", value)
            used = capacity_store.used_bytes
            assert used is not None and used <= self.CAPACITY
            assert capacity_store.get(f"k{i}") == value
        assert 1 <= len(capacity_store.keys()) <= 5

    def test_least_recently_used_leaves_first(self, capacity_store: Store):
        value = _payload(self.CAPACITY // 4 - 200)
        for key in "abcd":
            capacity_store.put(key, value)
        assert capacity_store.get("a") == value
        capacity_store.put("e", value)
        assert not capacity_store.contains("b")
        assert all(capacity_store.contains(k) for k in "acde")

    def test_value_larger_than_capacity_is_refused(self, capacity_store: Store):
        capacity_store.put("small", b"s")
        assert not capacity_store.put("huge", _payload(self.CAPACITY + 1))
        assert not capacity_store.contains("huge")
        assert capacity_store.get("small") == b"s"

    def test_refused_re_put_keeps_the_old_value(self, capacity_store: Store):
        assert capacity_store.put("k", b"old", {"tokens": 1})
        assert not capacity_store.put("k", _payload(self.CAPACITY + 1), {"tokens": 2})
        assert capacity_store.get("k") == b"old"
        info = capacity_store.info("k")
        assert info is not None and info.tokens == 1

    def test_evictions_are_counted(self, capacity_store: Store):
        value = _payload(self.CAPACITY // 4)
        for i in range(8):
            assert capacity_store.put(f"k{i}", value)
        assert capacity_store.stats()["evictions"] == 8 - len(capacity_store.keys()) > 0


class SharedStoreTests:
    """Several processes on one store at once: no failure, no wrong value, capacity kept.

    Subclasses provide a ``shared_url`` fixture: the URL of an empty store that
    other processes can open, bounded by ``SHARED_CAPACITY`` bytes or unbounded.
    The mix runs every way of reaching a store at once (``kvtool.testing.shared.KINDS``):
    library processes, threads of one process, a ``kvtool serve`` of the URL driven through
    its API, and ``kvtool store`` commands; a subclass whose store has a capacity gives it
    one below the workload's working set (40 keys of up to 48 KiB), so they evict each other's
    entries all along.
    """

    PROCESSES = 4
    OPS = 500
    SHARED_CAPACITY = 512 * 1024
    REFUSALS = 0.0  # the share of operations that may be puts the store refused (a server out of memory)
    WRITERS: ClassVar[dict[str, int]] = {"library": 2, "threads": 1, "api": 1, "cli": 1}
    WRITER_OPS: ClassVar[dict[str, int]] = {"library": 300, "threads": 150, "api": 100, "cli": 8}  # a command costs an interpreter start

    @pytest.fixture
    def shared_url(self) -> str:  # pragma: no cover - replaced by subclasses
        raise NotImplementedError("subclasses of SharedStoreTests provide a `shared_url` fixture")

    def test_processes_share_the_store(self, shared_url: str):
        check_shared(shared_url, run_processes(shared_url, self.PROCESSES, self.OPS), self.REFUSALS)

    def test_a_mix_of_writers_shares_the_store(self, shared_url: str):
        reports = run_mix(shared_url, self.WRITERS, self.WRITER_OPS, seed=1)
        assert sorted({r["kind"] for r in reports}) == sorted(self.WRITERS)
        check_shared(shared_url, reports, self.REFUSALS)
