"""The redis tier against a real redis-server: conformance, failures, TTL, passwords."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
import redis

from kvtool.store import TieredStore, open_store
from kvtool.store.memory import MemoryStore
from kvtool.store.redis import PASSWORD_ENV, RedisStore
from kvtool.testing import StoreTests


def _unique_prefix() -> str:
    return f"kvtool-test-{uuid.uuid4().hex[:12]}:"


def _raw_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5)


class TestRedisStore(StoreTests):
    @pytest.fixture
    def store(self, redis_url):
        prefix = _unique_prefix()
        store = RedisStore.from_url(f"{redis_url}?prefix={prefix}&timeout=5")
        yield store
        store.close()
        client = _raw_client(redis_url)
        for key in client.scan_iter(match=prefix + "*"):
            client.delete(key)


def test_server_down_is_a_logged_miss_and_puts_do_not_raise(redis_server, caplog):
    store = RedisStore(redis_server.url, timeout=0.5, connect_timeout=0.5, backoff=0.2)
    assert store.put("k", b"before")
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="kvtool.store"):
        assert store.get("k") is None
    assert "get 'k' failed" in caplog.text and "ConnectionError" in caplog.text
    assert store.put("k2", b"during") is False
    assert store.contains("k") is False
    assert store.keys() == []
    assert store.stats()["errors"] >= 1
    redis_server.start()
    time.sleep(0.3)  # past the backoff
    assert store.put("k3", b"after")
    assert store.get("k3") == b"after"
    store.close()


def test_value_damaged_inside_redis_is_a_miss(redis_url, caplog):
    prefix = _unique_prefix()
    with RedisStore(redis_url, prefix=prefix) as store:
        store.put("flipped", b"x" * 1000)
        store.put("cut", b"y" * 1000)
        client = _raw_client(redis_url)
        client.setrange(f"{prefix}flipped", 500, b"\x00")
        client.set(f"{prefix}cut", client.get(f"{prefix}cut")[:-1])
        with caplog.at_level(logging.WARNING, logger="kvtool.store"):
            assert store.get("flipped") is None
            assert store.get("cut") is None
        assert "checksum mismatch" in caplog.text and "length mismatch" in caplog.text
        assert client.exists(f"{prefix}flipped", f"{prefix}cut") == 0  # dropped


def test_entries_expire_after_a_day_by_default_or_never_if_asked(redis_url):
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    with open_store(f"{redis_url}?prefix={prefix}") as store:
        store.put("k", b"v")
        assert 86_000_000 < _raw_client(redis_url).pttl(f"{prefix}k") <= 86_400_000
    with open_store(f"{redis_url}?ttl=none&prefix={prefix}") as store:
        store.put("k", b"v")
        assert _raw_client(redis_url).pttl(f"{prefix}k") == -1  # no expiry
        assert "ttl=none" in store.describe()


def test_ttl_is_set_on_every_entry(redis_url):
    prefix = _unique_prefix()
    with open_store(f"{redis_url}?ttl=60&prefix={prefix}") as store:
        store.put("k", b"v")
        assert 0 < _raw_client(redis_url).pttl(f"{prefix}k") <= 60_000


def test_key_evicted_by_redis_is_a_miss_in_a_tiered_store(redis_url):
    prefix = _unique_prefix()
    tiers = [MemoryStore(capacity=1500), RedisStore(redis_url, prefix=prefix)]
    events = []
    with TieredStore(tiers) as store:
        store.subscribe(events.append)
        store.put("a", b"a" * 1000)
        store.put("b", b"b" * 1000)  # a moves down to redis
        assert store.tier_of("a") == "redis"
        _raw_client(redis_url).delete(f"{prefix}a")  # as Redis would under maxmemory or a TTL
        assert store.get("a") is None
        assert ("evicted", "a") in [(e.kind, e.key) for e in events]
        assert store.tier_of("a") is None


def test_promotion_from_redis_keeps_the_shared_copy(redis_url):
    prefix = _unique_prefix()
    with RedisStore(redis_url, prefix=prefix) as other_process:
        other_process.put("shared", b"from elsewhere", {"tokens": 4})
    with TieredStore([MemoryStore(), RedisStore(redis_url, prefix=prefix)]) as store:
        assert store.contains("shared")
        assert store.get("shared") == b"from elsewhere"
        assert store.tier_of("shared") == "memory"
        assert store.tiers[1].contains("shared")


def test_password_from_the_environment_and_never_shown(redis_server, monkeypatch, caplog):
    _raw_client(redis_server.url).config_set("requirepass", "s3cret-pw")
    port = redis_server.port
    monkeypatch.setenv(PASSWORD_ENV, "s3cret-pw")
    with open_store(f"redis://127.0.0.1:{port}/0") as store:
        assert store.put("k", b"v") and store.get("k") == b"v"
    monkeypatch.delenv(PASSWORD_ENV)
    with open_store(f"redis://:s3cret-pw@127.0.0.1:{port}/0") as store:
        assert store.get("k") == b"v"
        assert "s3cret-pw" not in repr(store) and "***" in repr(store)
        assert "s3cret-pw" not in str(store.stats())
    with caplog.at_level(logging.DEBUG, logger="kvtool.store"):
        with open_store(f"redis://:wrong-pw@127.0.0.1:{port}/0") as store:
            assert store.get("k") is None
            assert not store.put("k", b"other")
    assert "failed" in caplog.text and "wrong-pw" not in caplog.text


def test_prefixes_keep_stores_apart(redis_url):
    with RedisStore(redis_url, prefix=_unique_prefix()) as one, RedisStore(redis_url, prefix=_unique_prefix()) as two:
        one.put("k", b"one")
        assert two.get("k") is None and two.keys() == []
        assert one.keys() == ["k"]


def test_a_batch_is_one_round_trip_and_keeps_the_ttl(redis_url):
    prefix = _unique_prefix()
    client = _raw_client(redis_url)
    keys = [f"entry-{i}" for i in range(20)]

    def calls(command: str) -> int:
        return client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)

    with open_store(f"{redis_url}?ttl=60&prefix={prefix}") as store:
        assert store.put_many({key: key.encode() for key in keys}) == [True] * 20
        before = calls("mget"), calls("get")
        assert store.get_many(keys + ["absent"]) == [key.encode() for key in keys] + [None]
        assert (calls("mget"), calls("get")) == (before[0] + 1, before[1])
        assert store.contains_many(["entry-3", "absent"]) == [True, False]
    assert all(0 < client.pttl(f"{prefix}{key}") <= 60_000 for key in keys)


def test_a_batch_on_a_server_that_is_down_is_all_misses(redis_server, caplog):
    store = RedisStore(redis_server.url, timeout=0.5, backoff=30)
    assert store.put_many({"a": b"1", "b": b"2"}) == [True, True]
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="kvtool.store"):
        assert store.get_many(["a", "b"]) == [None, None]
        assert store.put_many({"c": b"3"}) == [False]
        assert store.contains_many(["a"]) == [False]
    assert caplog.text.count("the server is tried again") == 1
    assert store.stats()["put_failures"] == 1
    store.close()


def test_large_values_go_to_the_socket_without_a_copy(redis_url):
    value = b"v" * (8 * 1024 * 1024)
    with RedisStore(redis_url) as store:
        connection = store._client.connection_pool.make_connection()
        assert any(part is value for part in connection.pack_command("SET", b"k", value))


def _limit_memory(url: str, room: int, policy: str) -> int:
    """Give the server ``room`` bytes above what it uses now, under ``policy``; the limit set."""
    with _raw_client(url) as client:
        client.config_set("repl-backlog-size", 16384)
        limit = int(client.info("memory")["used_memory"]) + room
        client.config_set("maxmemory-policy", policy)
        client.config_set("maxmemory", limit)
    return limit


def test_under_maxmemory_noeviction_the_store_makes_room_among_its_own_entries(redis_server):
    """Redis's default policy refuses every write once full; the store evicts its own coldest entries, never
    another application's key, and keeps writing: a working set three times the room, nearly all stored."""
    with _raw_client(redis_server.url) as client:
        client.set("someone-else", b"x" * 100_000)
    _limit_memory(redis_server.url, 1 << 20, "noeviction")
    values = {f"chunk-{i}": bytes([i]) * 65536 for i in range(48)}  # 3 MiB
    with RedisStore(redis_server.url, prefix="kv:", ttl=None) as store:
        stored = [store.put(key, value) for key, value in values.items()]
        assert store.put_many({f"batch-{i}": b"b" * 65536 for i in range(8)}) == [True] * 8  # each key makes room
        stats = store.stats()
        assert sum(stored) >= 0.95 * len(stored)
        assert stats["put_refused"] == stored.count(False)  # a refused put is never silent
        assert stats["evictions"] > 0 and stats["server_refused_writes"] >= stats["evictions"] // 64
        assert stats["server_maxmemory_policy"] == "noeviction" and stats["server_maxmemory_bytes"] > 0
        kept = [key for key in values if store.get(key) == values[key]]  # the others: evicted, never wrong bytes
        assert 0 < len(kept) < len(values) and store.get_many(list(values)) == [values.get(k) if k in kept else None
                                                                                 for k in values]
    with _raw_client(redis_server.url) as client:
        assert client.get("someone-else") == b"x" * 100_000


def test_a_write_refused_with_nothing_to_evict_is_counted_and_the_server_stays_up(redis_server, caplog):
    with _raw_client(redis_server.url) as client:
        client.set("someone-else", b"x" * 300_000)  # what the store must not evict
    _limit_memory(redis_server.url, 0, "noeviction")  # and no room beside it
    with RedisStore(redis_server.url, backoff=30) as store, caplog.at_level(logging.WARNING, logger="kvtool.store"):
        assert store.put("k", b"v" * 1000) is False
        assert store.put_many({"a": b"1" * 1000, "b": b"2" * 1000}) == [False, False]
        assert store.contains("k") is False and store.get("k") is None  # asked: the breaker did not trip
        stats = store.stats()
        assert stats["put_refused"] == 3 and stats["put_failures"] == 3 and stats["errors"] == 0
        assert stats["server_refused_writes"] >= 3
    assert caplog.text.count("write for lack of memory, with no room to make") == 3


def test_the_maxmemory_benchmark_in_short_stores_nearly_every_put_and_reports_every_refusal():
    """benchmarks/redis_maxmemory.py as CI runs it: four writing processes, a working set three times the room,
    under Redis's default policy and under allkeys-lru (BENCHMARKS.md has the long runs)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "redis_maxmemory.py"
    run = subprocess.run([sys.executable, str(script), "--budget-mib", "4", "--writers", "4", "--passes", "2",
                          "--json"], capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    cases = json.loads(run.stdout.strip().splitlines()[-1])["cases"]
    assert [c["policy"] for c in cases] == ["noeviction", "allkeys-lru"]
    for case in cases:
        assert case["working_set_bytes"] >= 3 * case["budget_bytes"]
        assert case["unreported"] == 0 and case["stored_share"] >= 0.95, case
        assert case["put_failures"] == case["puts"] - case["stored"]
    assert cases[0]["evictions"] > 0 and cases[0]["server_refused_writes"] > 0  # the store made the room
    assert cases[1]["server_evicted_keys"] > 0  # Redis did
