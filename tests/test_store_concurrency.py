"""TieredStore under threads: a slow tier being written never blocks hits in the memory tier.

The slow tier is a real file tier whose writes wait at a gate the test opens. Each
test checks the order in which things finish (a hit returns while the gate is
still shut), never how long anything takes; the timeouts only stop a broken
store from hanging the suite.
"""

from __future__ import annotations

import threading

import pytest

from kvtool.store import TieredStore
from kvtool.store.entry import wrap
from kvtool.store.file import FileStore
from kvtool.store.memory import MemoryStore

WAIT = 30  # seconds before a test gives up on a thread; never reached by a working store


class _GatedFileStore(FileStore):
    """A file tier whose writes wait until the test opens the gate; ``writing`` is set when one waits."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.gate = threading.Event()
        self.writing = threading.Event()

    def _write(self, info, record):
        self.writing.set()
        assert self.gate.wait(WAIT), "the test never opened the gate"
        return super()._write(info, record)


def _value(i: int) -> bytes:
    return bytes([i]) * 1000


@pytest.fixture
def stacked(tmp_path):
    """Memory with room for two entries over a gated file tier."""
    size = len(wrap("k0", _value(0), {}).record)
    slow = _GatedFileStore(tmp_path / "file")
    store = TieredStore([MemoryStore(capacity=2 * size), slow])
    yield store, slow
    slow.gate.set()
    store.close()


def _start(name: str, done: list[str], call) -> threading.Thread:
    """Run ``call`` in a thread that appends ``name`` to ``done`` when it returns."""
    results = {}

    def run():
        results[name] = call()
        done.append(name)

    thread = threading.Thread(target=run, daemon=True)
    thread.results = results
    thread.start()
    return thread


def test_memory_hits_return_while_a_demotion_writes_to_a_slow_tier(stacked):
    store, slow = stacked
    store.put("k0", _value(0))
    store.put("k1", _value(1))
    done: list[str] = []
    put = _start("put k2", done, lambda: store.put("k2", _value(2)))  # k0 must move down to the file tier
    assert slow.writing.wait(WAIT)
    hits = [
        _start("get k1", done, lambda: store.get("k1")),
        _start("get k0", done, lambda: store.get("k0")),  # the entry being demoted: still read where it is
        _start("tier_of k1", done, lambda: store.tier_of("k1")),
        _start("stats", done, lambda: store.stats()["tiers"][0]["entries"]),
    ]
    for thread in hits:
        thread.join(WAIT)
    done.append("gate opened")
    slow.gate.set()
    put.join(WAIT)
    assert set(done[:4]) == {"get k1", "get k0", "tier_of k1", "stats"} and done[4:] == ["gate opened", "put k2"]
    assert [t.results for t in hits] == [{"get k1": _value(1)}, {"get k0": _value(0)}, {"tier_of k1": "memory"}, {"stats": 2}]
    assert put.results == {"put k2": True}
    assert (store.tier_of("k0"), store.tier_of("k1"), store.tier_of("k2")) == ("file", "memory", "memory")


def test_a_second_put_of_a_key_waits_for_the_first(stacked):
    store, slow = stacked
    store.put("k0", _value(0))
    store.put("k1", _value(1))
    done: list[str] = []
    first = _start("first", done, lambda: store.put("k2", _value(2)))  # waits at the gate, demoting k0
    assert slow.writing.wait(WAIT)
    second = _start("second", done, lambda: store.put("k2", _value(3)))
    other = _start("other key", done, lambda: store.get("k1"))
    other.join(WAIT)
    done.append("gate opened")
    slow.gate.set()
    first.join(WAIT)
    second.join(WAIT)
    assert done == ["other key", "gate opened", "first", "second"]
    assert store.get("k2") == _value(3)


def test_puts_and_gets_from_many_threads_keep_every_value(tmp_path):
    size = len(wrap("t0-k0", _value(0), {}).record)
    slow = _GatedFileStore(tmp_path / "file")
    slow.gate.set()
    with TieredStore([MemoryStore(capacity=3 * size), slow]) as store:
        def work(t: int) -> list[bool]:
            ok = []
            for i in range(20):
                key = f"t{t}-k{i}"
                ok.append(store.put(key, _value((t * 20 + i) % 251)))
                ok.append(store.get(f"t{t}-k{i // 2}") == _value((t * 20 + i // 2) % 251))
            return ok

        threads = [_start(f"t{t}", [], lambda t=t: work(t)) for t in range(4)]
        for thread in threads:
            thread.join(WAIT)
        assert all(all(ok) for thread in threads for ok in thread.results.values())
        assert sorted(store.keys()) == sorted(f"t{t}-k{i}" for t in range(4) for i in range(20))
        assert store.tiers[0].used_bytes <= store.tiers[0].capacity
        assert all(store.get(f"t{t}-k{i}") == _value((t * 20 + i) % 251) for t in range(4) for i in range(20))


def test_a_stacked_memory_tier_leaves_eviction_to_the_policy(tmp_path):
    size = len(wrap("k0", _value(0), {}).record)
    memory = MemoryStore(capacity=2 * size)
    with TieredStore([memory, FileStore(tmp_path / "file")]):
        assert memory.put("k0", _value(0)) and memory.put("k1", _value(1))
        memory.get("k0")  # no recency of its own: the policy orders entries
        assert not memory.put("k2", _value(2))  # refused instead of evicting by itself
        assert memory.keys() == ["k0", "k1"] and memory.stats()["evictions"] == 0
    alone = MemoryStore(capacity=2 * size)
    alone.put("k0", _value(0))
    alone.put("k1", _value(1))
    alone.get("k0")
    assert alone.put("k2", _value(2)) and alone.keys() == ["k0", "k2"]  # on its own it evicts the least recent
