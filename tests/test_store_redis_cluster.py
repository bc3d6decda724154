"""The cluster tier against a real 6-process Redis Cluster: conformance, batches, failover, passwords."""

from __future__ import annotations

import logging
import socket
import time
import uuid

import pytest
import redis
from redis.cluster import RedisCluster

from kvtool.errors import UsageError
from kvtool.store import TieredStore, open_store
from kvtool.store.redis import PASSWORD_ENV
from kvtool.store.redis_cluster import RedisClusterStore, parse_cluster_url
from kvtool.store.url import split_urls
from kvtool.testing import SharedStoreTests, StoreTests
from kvtool.testing.shared import MAX_VALUE


def _unique_prefix() -> str:
    return f"kvtool-test-{uuid.uuid4().hex[:12]}:"


def _raw_client(url: str) -> RedisCluster:
    """redis-py's own cluster client, to look at what the store wrote."""
    _, nodes, _ = parse_cluster_url(url.split("?")[0], url)
    host, port = nodes[0]
    return RedisCluster(host=host, port=port, socket_timeout=5)


def _master_of(client: RedisCluster, key: str) -> int:
    return client.get_node_from_key(key).port


@pytest.fixture
def prefix(redis_cluster_url):
    prefix = _unique_prefix()
    yield prefix
    client = _raw_client(redis_cluster_url)
    for key in client.scan_iter(match=prefix + "*"):
        client.delete(key)
    client.close()


class TestRedisClusterStore(StoreTests):
    @pytest.fixture
    def store(self, redis_cluster_url, prefix):
        store = RedisClusterStore.from_url(f"{redis_cluster_url}?prefix={prefix}&timeout=5")
        yield store
        store.close()


class TestRedisClusterShared(SharedStoreTests):
    """Every kind of writer at once on one cluster whose masters hold less than the working set:
    each master evicts (``allkeys-lru``) within ``maxmemory`` set at what it uses plus ``ROOM``.
    Redis counts its replication backlog as used memory, so the backlog is held at its least
    (16 KiB); at 1 MiB it would grow into the room and make Redis refuse writes instead of evicting."""

    ROOM = 512 * 1024  # for keys and for the clients' buffers, which Redis counts too: the 40 keys do not fit
    # Redis refuses a write (OOM) when the clients' buffers alone fill the room, as they do at
    # moments with every writer sending 48 KiB values, the more the slower the machine; kvtool
    # reports it as not stored. Such refusals are Redis's policy, not failures: they are bounded
    # here only so that a store refusing everything still fails.
    REFUSALS = 0.5

    @pytest.fixture
    def shared_url(self, redis_cluster):
        masters = [port for port in redis_cluster.ports if _role(port) == "master"]
        limits = {}
        for port in masters:
            with redis.Redis(port=port, socket_timeout=5) as client:
                client.config_set("repl-backlog-size", 16384)
                client.config_set("maxmemory-policy", "allkeys-lru")
                limits[port] = int(client.info("memory")["used_memory"]) + self.ROOM
                client.config_set("maxmemory", limits[port])
        yield f"{redis_cluster.url}?prefix=shared:&timeout=5"
        evicted = 0
        for port in masters:
            with redis.Redis(port=port, socket_timeout=5) as client:
                # The capacity held: Redis evicts before a write, so it may end one value over. Counted as
                # Redis counts it for maxmemory: without the replicas' buffers of writes not yet sent to them
                # (mem_not_counted_for_evict), which grow while a loaded machine's replicas lag.
                memory = client.info("memory")
                counted = int(memory["used_memory"]) - int(memory["mem_not_counted_for_evict"])
                assert counted <= limits[port] + MAX_VALUE + 4096
                evicted += int(client.info("stats")["evicted_keys"])
        assert evicted > 0  # the working set did not fit


def _role(port: int) -> str:
    with redis.Redis(port=port, socket_timeout=5) as client:
        return str(client.info("replication")["role"])


def test_entries_spread_over_every_master(redis_cluster_url, prefix):
    with open_store(f"{redis_cluster_url}?prefix={prefix}") as store:
        assert all(store.put_many({f"chunk-{i}": bytes([i]) * 100 for i in range(60)}))
    client = _raw_client(redis_cluster_url)
    masters = {_master_of(client, f"{prefix}chunk-{i}") for i in range(60)}
    assert len(masters) == 3
    assert len(list(client.scan_iter(match=prefix + "*"))) == 60
    client.close()


def test_batches_cross_slots_and_keep_the_ttl(redis_cluster_url, prefix):
    values = {f"entry-{i}": f"value {i}".encode() * (i + 1) for i in range(40)}
    with open_store(f"{redis_cluster_url}?prefix={prefix}&ttl=60") as store:
        assert store.put_many(values) == [True] * 40
        keys = list(values) + ["absent"]
        assert store.get_many(keys) == list(values.values()) + [None]
        assert store.contains_many(keys) == [True] * 40 + [False]
        assert sorted(store.keys()) == sorted(values)
        stats = store.stats()
        assert (stats["hits"], stats["misses"], stats["puts"]) == (40, 1, 40)
    client = _raw_client(redis_cluster_url)
    assert all(0 < client.pttl(f"{prefix}{key}") <= 60_000 for key in values)
    client.close()


def test_a_batch_read_is_one_mget_per_hash_slot(redis_cluster_url, prefix):
    client = _raw_client(redis_cluster_url)
    keys = [f"entry-{i}" for i in range(30)]
    slots = {client.keyslot(f"{prefix}{key}") for key in keys}

    def mget_calls() -> int:
        stats = client.info("commandstats", target_nodes=RedisCluster.PRIMARIES)
        return sum(node.get("cmdstat_mget", {}).get("calls", 0) for node in stats.values())

    with open_store(f"{redis_cluster_url}?prefix={prefix}") as store:
        store.put_many({key: b"v" for key in keys})
        before = mget_calls()
        assert store.get_many(keys) == [b"v"] * 30
        assert mget_calls() - before == len(slots)
    client.close()


def test_a_damaged_entry_in_a_batch_is_a_miss_and_the_rest_are_served(redis_cluster_url, prefix, caplog):
    with open_store(f"{redis_cluster_url}?prefix={prefix}") as store:
        store.put_many({"good": b"g" * 1000, "bad": b"b" * 1000})
        client = _raw_client(redis_cluster_url)
        client.setrange(f"{prefix}bad", 500, b"\x00")
        with caplog.at_level(logging.WARNING, logger="kvtool.store"):
            assert store.get_many(["bad", "good"]) == [None, b"g" * 1000]
        assert "checksum mismatch" in caplog.text
        assert client.exists(f"{prefix}bad") == 0  # dropped
        client.close()


def test_a_cluster_url_is_one_tier_of_a_list(redis_cluster_url, prefix, tmp_path):
    nodes = redis_cluster_url.removeprefix("redis+cluster://")
    url = f"memory://,redis+cluster://{nodes}/?prefix={prefix}&ttl=30,file://{tmp_path}"
    with open_store(url) as store:
        assert isinstance(store, TieredStore)
        assert [tier.scheme for tier in store.tiers] == ["memory", "redis+cluster", "file"]
        assert store.tiers[1].describe() == f"redis+cluster://{nodes}/?ttl=30&prefix={prefix}"


@pytest.mark.parametrize("url", [
    "redis+cluster://127.0.0.1:7000/1",
    "redis+cluster://127.0.0.1:7000,127.0.0.1:notaport",
    "redis+cluster://127.0.0.1:7000,:7001",
    "redis+cluster://127.0.0.1:7000?db=0",
])
def test_bad_cluster_urls_are_usage_errors(url):
    with pytest.raises(UsageError):
        open_store(url)


@pytest.mark.parametrize("text, urls", [
    ("redis+cluster://a:1,b:2,c:3", ["redis+cluster://a:1,b:2,c:3"]),
    ("memory://,redis+cluster://a:1,b:2/?ttl=5,file:///x", ["memory://", "redis+cluster://a:1,b:2/?ttl=5", "file:///x"]),
    ("rediss+cluster://u:pw@a:1,[::1]:2?prefix=p", ["rediss+cluster://u:pw@a:1,[::1]:2?prefix=p"]),
    ("redis://h:6379/0,b:2", ["redis://h:6379/0", "b:2"]),  # a database path ends the node list
    ("file:///tmp/a,b:1", ["file:///tmp/a", "b:1"]),
    ("memory://,,file:///x", ["memory://", "", "file:///x"]),
])
def test_a_cluster_node_list_stays_one_url_in_a_tier_list(text, urls):
    assert split_urls(text) == urls


def test_node_lists_with_passwords_and_ipv6():
    scheme, nodes, credentials = parse_cluster_url("rediss+cluster://kv:p%2Cw@[::1]:7000,host-b:7001,host-c/", "shown")
    assert scheme == "rediss+cluster"
    assert nodes == [("::1", 7000), ("host-b", 7001), ("host-c", 6379)]
    assert credentials == {"username": "kv", "password": "p,w"}


def test_large_values_go_to_the_socket_without_a_copy(redis_cluster_url, prefix):
    value = b"v" * (8 * 1024 * 1024)
    with open_store(f"{redis_cluster_url}?prefix={prefix}") as store:
        assert store.put("warm", b"up")  # connects
        node = store._client.get_node_from_key(store._k("k"))
        connection = store._client.get_redis_connection(node).connection_pool.make_connection()
        packed = connection.pack_command("SET", store._k("k"), value)
        assert any(part is value for part in packed)
        connection.disconnect()


def test_password_from_the_environment_and_never_shown(redis_cluster, monkeypatch, caplog):
    for port in redis_cluster.ports:
        with redis.Redis(port=port, socket_timeout=5) as node:
            node.config_set("masterauth", "s3cret-pw")
            node.config_set("requirepass", "s3cret-pw")
    nodes = redis_cluster.url.removeprefix("redis+cluster://")
    monkeypatch.setenv(PASSWORD_ENV, "s3cret-pw")
    with open_store(redis_cluster.url) as store:
        assert store.put("k", b"v") and store.get("k") == b"v"
    monkeypatch.delenv(PASSWORD_ENV)
    with open_store(f"redis+cluster://:s3cret-pw@{nodes}") as store:
        assert store.get("k") == b"v"
        assert "s3cret-pw" not in repr(store) and "***" in repr(store)
        assert "s3cret-pw" not in str(store.stats())
    with caplog.at_level(logging.DEBUG, logger="kvtool.store"):
        with open_store(f"redis+cluster://:wrong-pw@{nodes}") as store:
            assert store.get("k") is None
            assert not store.put("k", b"other")
    assert "failed" in caplog.text and "wrong-pw" not in caplog.text


def test_the_tls_form_over_a_cluster_that_speaks_only_tls(redis_cluster_tls, caplog):
    assert redis_cluster_tls.url.startswith("rediss+cluster://")
    value = b"over tls " * 100_000
    with open_store(f"{redis_cluster_tls.url}&prefix=tls:") as store:
        assert store.put_many({"a": value, "b": b"small"}) == [True, True]
        assert store.get_many(["a", "b", "c"]) == [value, b"small", None]
        assert sorted(store.keys()) == ["a", "b"]
    plain = redis_cluster_tls.url.replace("rediss+cluster", "redis+cluster").partition("?")[0]
    with caplog.at_level(logging.WARNING, logger="kvtool.store"):
        with open_store(f"{plain}?prefix=tls:") as store:
            assert store.get("a") is None
    assert "treated as a miss" in caplog.text


def test_a_cluster_that_cannot_be_reached_is_a_logged_miss_with_a_breaker(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open_store(f"redis+cluster://127.0.0.1:{port}?backoff=30") as store:  # nothing listens there
        with caplog.at_level(logging.DEBUG, logger="kvtool.store"):
            assert store.get("k") is None
            assert store.put("k", b"v") is False
            assert store.get_many(["a", "b"]) == [None, None]
            assert store.contains_many(["a"]) == [False]
            assert store.keys() == []
        assert caplog.text.count("the cluster is tried again") == 1  # one attempt, then the breaker
        assert "skipped" in caplog.text
        assert store.stats()["errors"] >= 4


def test_a_killed_master_is_a_miss_until_its_replica_takes_over(redis_cluster, caplog):
    """Kill a master mid-run: its keys miss quickly, the rest is served, and after the failover all works."""
    url = f"{redis_cluster.url}?timeout=0.5&connect_timeout=0.5&backoff=0.2"
    keys = [f"chunk-{i}" for i in range(60)]
    values = {key: key.encode() * 100 for key in keys}
    client = _raw_client(redis_cluster.url)
    victim = _master_of(client, "kvtool:chunk-0")
    lost = [key for key in keys if _master_of(client, f"kvtool:{key}") == victim]
    kept = [key for key in keys if key not in lost]
    with open_store(url) as store:
        assert store.put_many(values) == [True] * 60
        # Every replica has the entries before its master dies (replication is asynchronous).
        assert client.get_redis_connection(client.get_node(port=victim, host="127.0.0.1")).execute_command("WAIT", 1, 5000) == 1
        client.close()

        redis_cluster.kill(victim)
        with caplog.at_level(logging.WARNING, logger="kvtool.store"):
            for _ in range(3):
                start = time.monotonic()
                got = store.get_many(keys)
                one = store.get(lost[0])
                stored = store.put(lost[1], b"during")
                assert time.monotonic() - start < 10  # bounded by the timeouts, not hung
                assert [got[keys.index(k)] for k in kept] == [values[k] for k in kept]
                assert all(got[keys.index(k)] is None for k in lost)
                assert one is None and stored is False
                time.sleep(0.1)
        assert f"node 127.0.0.1:{victim}" in caplog.text

        survivor = next(p for p in redis_cluster.ports if p != victim)
        _wait_until(lambda: redis_cluster.info(survivor)["cluster_slots_ok"] == "16384", 60, "no replica took over")
        assert redis_cluster.info(survivor)["cluster_state"] == "ok"
        _wait_until(lambda: store.put(lost[1], b"after"), 30, "puts did not recover after the failover")
        assert store.get(lost[1]) == b"after"
        assert store.get_many(keys) == [b"after" if k == lost[1] else values[k] for k in keys]

        for port in redis_cluster.ports:  # now the whole cluster goes down
            if port != victim:
                redis_cluster.kill(port)
        with caplog.at_level(logging.WARNING, logger="kvtool.store"):
            assert store.get(kept[0]) is None
            assert store.put(kept[0], b"x") is False
            assert store.get_many(keys) == [None] * 60
        assert "treated as a miss" in caplog.text


def _wait_until(condition, seconds: float, message: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.2)


def test_under_maxmemory_noeviction_each_master_makes_room_among_the_store_s_entries(redis_cluster):
    """Redis's default policy on every master, each given 512 KiB of room: a working set three times the cluster's
    room is written, and the store evicts its own coldest entries on the master that refused, nearly every put
    stored, every refusal counted."""
    masters = [port for port in redis_cluster.ports if _role(port) == "master"]
    for port in masters:
        with redis.Redis(port=port, socket_timeout=5) as client:
            client.config_set("repl-backlog-size", 16384)
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 512 * 1024)
    values = {f"chunk-{i}": bytes([i % 256]) * 32768 for i in range(144)}  # 4.5 MiB over 1.5 MiB of room
    with open_store(f"{redis_cluster.url}?prefix=room:&ttl=none&timeout=5") as store:
        stored = [store.put(key, value) for key, value in values.items()]
        stored += store.put_many({f"batch-{i}": b"b" * 32768 for i in range(24)})
        stats = store.stats()
        assert sum(stored) >= 0.95 * len(stored), stats
        assert stats["put_refused"] == stored.count(False) and stats["evictions"] > 0
        assert stats["server_refused_writes"] > 0 and stats["errors"] == 0
        held = [key for key, ok in zip(values, store.contains_many(list(values))) if ok]
        assert held and all(store.get(key) == values[key] for key in held)
