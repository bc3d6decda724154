"""What LMCache 0.5.6's ``L2AdapterInterface`` asks of an adapter, held against kvtool's adapter, one obligation a test.

    .venv-lmcache/bin/python -m pytest tests/lmcache_e2e/test_l2_contract.py

Written from the interface (lmcache/v1/distributed/l2_adapters/base.py and
internal_api.py) as LMCache's store and prefetch controllers use it: three
distinct event fds, each signalled when a task of its kind completes; task ids
whose results come back exactly once; a store result per task with the bytes
written; lookup-and-lock and load bitmaps per key; locks released by unlocks
that never fail; deletes; listeners told of keys stored (with sizes), accessed
(loaded) and deleted (also when the store evicts by itself); usage per
``cache_salt`` as the base class sums what the adapter reports; a restarted
adapter that finds its chunks again; two controller threads at once. Objects
here are small and of any size (LMCache's benchmark payloads, odd and empty
ones); tests/lmcache_e2e/test_lmcache_adapter.py holds real KV chunks.
"""

from __future__ import annotations

import os
import select
import threading

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed here: create its environment with "
                                      "benchmarks/vs_lmcache/lmcache-env.sh")
import torch  # noqa: E402
from chunk_objects import memory_obj  # noqa: E402  (beside this file)
from l2_calls import Listener, adapter_of, bits, key, load, lookup, store, wait  # noqa: E402

from kvtool.integrations.lmcache import KvtoolL2AdapterConfig  # noqa: E402


def payload(n: int, seed: int) -> torch.Tensor:
    """``n`` incompressible bytes: what LMCache's own benchmark stores."""
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def obj(n: int, seed: int = 0):
    return memory_obj(payload(n, seed))


def blank(n: int):
    return memory_obj(torch.full((n,), 0xA5, dtype=torch.uint8))


@pytest.fixture
def adapter(tmp_path):
    made = adapter_of({"store": f"file://{tmp_path}/kv"})
    yield made
    made.close()


def raw(o) -> bytes:
    """A memory object's bytes (LMCache cannot give an empty object's ``byte_array``)."""
    return bytes(o.byte_array) if o.get_size() else b""


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def consume(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass


def test_three_distinct_event_fds_each_signalled_by_its_own_kind_of_task(tmp_path, adapter):
    other = adapter_of({"store": f"file://{tmp_path}/other"})
    try:
        fds = [adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()]
        assert len(set(fds)) == 3
        assert not set(fds) & {other.get_store_event_fd(), other.get_lookup_and_lock_event_fd(),
                               other.get_load_event_fd()}
    finally:
        other.close()
    for fd in fds:
        consume(fd)
    store(adapter, [key(1)], [obj(100)])
    assert [readable(fd) for fd in fds] == [True, False, False]
    consume(fds[0])
    lookup(adapter, [key(1)])
    assert [readable(fd) for fd in fds] == [False, True, False]
    consume(fds[1])
    load(adapter, [key(1)], [blank(100)])
    assert [readable(fd) for fd in fds] == [False, False, True]


def test_task_ids_are_distinct_and_each_result_is_handed_over_once(adapter):
    tasks = [adapter.submit_store_task([key(i)], [obj(64, i)]) for i in range(4)]
    assert len(set(tasks)) == 4
    seen: dict = {}
    while len(seen) < 4:
        select.select([adapter.get_store_event_fd()], [], [], 0.05)
        popped = adapter.pop_completed_store_tasks()
        assert not set(popped) & set(seen)  # popped once
        seen.update(popped)
    assert set(seen) == set(tasks) and all(r.is_successful() for r in seen.values())
    task = adapter.submit_lookup_and_lock_task([key(0), key(9)], {})
    assert bits(wait(adapter.query_lookup_and_lock_result, task, adapter.get_lookup_and_lock_event_fd()), 2) \
        == [True, False]
    assert adapter.query_lookup_and_lock_result(task) is None  # not idempotent: once only
    task = adapter.submit_load_task([key(0)], [blank(64)])
    assert bits(wait(adapter.query_load_result, task, adapter.get_load_event_fd()), 1) == [True]
    assert adapter.query_load_result(task) is None
    assert adapter.query_load_result(10_000) is None and adapter.query_lookup_and_lock_result(10_000) is None
    adapter.submit_unlock([key(0)])


def test_a_store_result_counts_the_bytes_written_and_a_stored_key_again_is_success_with_none(adapter):
    first = store(adapter, [key(1), key(2)], [obj(4096, 1), obj(4096, 2)])
    assert first.is_successful() and first.bytes_transferred() > 8192  # incompressible, plus each entry's header
    again = store(adapter, [key(1)], [obj(4096, 1)])
    assert again.is_successful() and again.bytes_transferred() == 0


@pytest.mark.parametrize("sizes", [[0, 1, 13, 4097, 262145]])
def test_objects_of_any_size_round_trip_bit_for_bit(adapter, sizes):
    keys = [key(i) for i in range(len(sizes))]
    objs = [obj(n, n) for n in sizes]
    assert store(adapter, keys, objs).is_successful()
    outs = [blank(n) for n in sizes]
    assert load(adapter, keys, outs) == [True] * len(sizes)
    for out, sent in zip(outs, objs):
        assert raw(out) == raw(sent)


def test_each_key_of_a_task_succeeds_or_fails_alone(tmp_path):
    """A store too small for one object: that key fails, the task reports failure (LMCache keeps all of it in L1),
    and every other key is stored, told to LMCache, counted in its usage and loads."""
    adapter = adapter_of({"store": f"file://{tmp_path}/kv?capacity=64KiB"})
    listener = Listener()
    adapter.register_listener(listener)
    try:
        keys = [key(1), key(2), key(3), key(4)]
        objs = [obj(1000, 1), obj(200_000, 2), obj(1001, 3), obj(7, 4)]  # the second cannot fit
        result = store(adapter, keys, objs)
        assert not result.is_successful()
        assert [k for k, _ in listener.stored] and {k for k, _ in listener.stored} == {key(1), key(3), key(4)}
        assert adapter.get_usage().total_bytes_used == sum(size for _, size in listener.stored)
        assert lookup(adapter, keys) == [True, False, True, True]
        outs = [blank(o.get_size()) for o in objs]
        assert load(adapter, keys, outs) == [True, False, True, True]
        assert all(bytes(outs[i].byte_array) == bytes(objs[i].byte_array) for i in (0, 2, 3))
        assert bytes(outs[1].byte_array) == bytes(blank(200_000).byte_array)  # a miss writes nothing
        adapter.submit_unlock(keys)
        counters = adapter.report_status()["counters"]
        assert counters["store_failures|refused"] == 1 and counters["chunks_stored|bytes"] == 3
    finally:
        adapter.close()


def test_lookup_and_load_answer_each_key_and_an_empty_task_finishes(adapter):
    store(adapter, [key(1), key(3)], [obj(50, 1), obj(50, 3)])
    assert lookup(adapter, [key(1), key(2), key(3), key(1, salt="x"), key(1, rank=1)]) == [True, False, True, False,
                                                                                            False]
    assert lookup(adapter, []) == []
    assert load(adapter, [], []) == []
    assert store(adapter, [], []).is_successful()
    outs = [blank(50), blank(50), blank(50)]
    assert load(adapter, [key(3), key(2), key(1)], outs) == [True, False, True]
    adapter.submit_unlock([key(1), key(3)])


def test_a_locked_entry_outlives_the_store_s_eviction_until_it_is_unlocked(tmp_path):
    adapter = adapter_of({"store": f"file://{tmp_path}/kv?capacity=40KiB"})
    try:
        store(adapter, [key(0)], [obj(10_000, 0)])
        assert lookup(adapter, [key(0)]) == [True]  # locked
        assert lookup(adapter, [key(0)]) == [True]  # locked twice
        for i in range(1, 9):  # three times the capacity after it
            store(adapter, [key(i)], [obj(10_000, i)])
        assert adapter.report_status()["counters"]["chunks_evicted"] >= 4
        adapter.submit_unlock([key(0)])  # one lock left
        for i in range(9, 13):
            store(adapter, [key(i)], [obj(10_000, i)])
        out = blank(10_000)
        assert load(adapter, [key(0)], [out]) == [True] and bytes(out.byte_array) == bytes(obj(10_000, 0).byte_array)
        adapter.submit_unlock([key(0)])
        adapter.submit_unlock([key(0), key(99)])  # more unlocks than locks, and a key never locked: no error
        assert adapter.report_status()["chunks_locked"] == 0
        for i in range(13, 18):
            store(adapter, [key(i)], [obj(10_000, i)])
        assert lookup(adapter, [key(0)]) == [False]  # unlocked: evicted like the others
    finally:
        adapter.close()


def test_listeners_and_usage_follow_stores_loads_deletes_and_evictions(tmp_path):
    adapter = adapter_of({"store": f"file://{tmp_path}/kv?capacity=48KiB"})
    listener = Listener()
    adapter.register_listener(listener)
    try:
        store(adapter, [key(1, "a"), key(2, "b"), key(3, "b")], [obj(5000, 1), obj(5000, 2), obj(5000, 3)])
        sizes = dict(listener.stored)
        assert all(size > 5000 for size in sizes.values())  # the entry's size, as the store keeps it
        usage = adapter.get_usage()
        assert usage.total_bytes_used == sum(sizes.values()) and usage.total_capacity_bytes == 0
        assert dict(usage.bytes_by_cache_salt) == {"a": sizes[key(1, "a")], "b": sizes[key(2, "b")] + sizes[key(3, "b")]}
        load(adapter, [key(2, "b")], [blank(5000)])
        assert listener.accessed == [key(2, "b")]
        adapter.delete([key(2, "b"), key(9, "b")])  # a key never stored is no error
        assert listener.deleted == [key(2, "b")] and lookup(adapter, [key(2, "b")]) == [False]
        assert dict(adapter.get_usage().bytes_by_cache_salt) == {"a": sizes[key(1, "a")], "b": sizes[key(3, "b")]}
        for i in range(10, 20):  # the store evicts by itself: LMCache hears of it
            store(adapter, [key(i, "c")], [obj(5000, i)])
        evicted = set(listener.deleted) - {key(2, "b")}
        assert evicted and key(1, "a") in evicted
        held = {k for k, _ in listener.stored} - set(listener.deleted)
        assert adapter.get_usage().total_bytes_used == sum(size for k, size in listener.stored if k in held)
    finally:
        adapter.close()


def test_a_restarted_adapter_finds_every_chunk_and_the_same_usage(tmp_path):
    url = f"file://{tmp_path}/kv"
    first = adapter_of({"store": url})
    store(first, [key(1, "a"), key(2, "b"), key(3, "")], [obj(3000, 1), obj(31, 2), obj(0, 3)])
    usage = first.get_usage()
    first.close()
    second = adapter_of({"store": url})
    listener = Listener()
    try:
        again = second.get_usage()
        assert again.total_bytes_used == usage.total_bytes_used
        assert dict(again.bytes_by_cache_salt) == dict(usage.bytes_by_cache_salt)
        second.register_listener(listener)  # told of the chunks found again, with their sizes
        assert {k for k, _ in listener.stored} == {key(1, "a"), key(2, "b"), key(3, "")}
        out = blank(31)
        assert load(second, [key(2, "b")], [out]) == [True] and bytes(out.byte_array) == bytes(obj(31, 2).byte_array)
    finally:
        second.close()


def test_two_controller_threads_at_once(adapter):
    """LMCache's store controller and prefetch controller call the adapter from two threads."""
    errors: list[BaseException] = []

    def storing() -> None:
        try:
            for i in range(40):
                assert store(adapter, [key(i), key(1000 + i)], [obj(300, i), obj(301, 1000 + i)]).is_successful()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)

    def fetching() -> None:
        try:
            for i in range(40):
                keys = [key(i), key(1000 + i)]
                found = lookup(adapter, keys)
                outs = [blank(300), blank(301)]
                loaded = load(adapter, keys, outs)
                for hit, ok, out, n in zip(found, loaded, outs, (i, 1000 + i)):
                    if ok:
                        assert bytes(out.byte_array) == bytes(obj(out.get_size(), n).byte_array)
                adapter.submit_unlock([k for k, hit in zip(keys, found) if hit])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=storing), threading.Thread(target=fetching)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert lookup(adapter, [key(i) for i in range(40)]) == [True] * 40
    adapter.submit_unlock([key(i) for i in range(40)])
    assert adapter.report_status()["chunks_locked"] == 0


def test_a_configuration_mistake_is_a_value_error_with_one_line(tmp_path):
    """LMCache reports a ValueError from an adapter's config, or from making the adapter, as the user's mistake."""
    for params in ({}, {"store": "file:///x", "recipe": "nope"}, {"store": "file:///x", "workers": 0},
                   {"store": "nosuch://x"}, {"store": f"file://{tmp_path}/kv?capacity=lots"}):
        with pytest.raises(ValueError) as info:
            adapter_of(params)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError):
        KvtoolL2AdapterConfig.from_dict({"store": "file:///x", "colour": "red"})


def test_status_and_close(tmp_path):
    adapter = adapter_of({"store": f"file://{tmp_path}/kv"})
    fds = [adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()]
    status = adapter.report_status()
    assert status["is_healthy"] is True and status["store_stats"]["entries"] == 0
    adapter.close()
    adapter.close()  # twice: no error
    for fd in fds:  # the adapter closed its event fds
        with pytest.raises(OSError):
            os.fstat(fd)
