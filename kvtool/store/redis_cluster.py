"""The redis tier over a Redis Cluster: one store shared by every server, spread over its masters.

``redis+cluster://[[user]:password@]host:port[,host:port...][/][?options]``
(``rediss+cluster://`` for TLS) names some nodes of the cluster; the client
learns the rest and which master holds which hash slot from them. Options and
the password are those of ``redis://`` (``kvtool.store.redis``). Keys spread
over the slots by hash; a key prefix containing ``{...}`` would put every entry
in one slot, on one master.

Failures are handled per master: when the master that holds a key cannot be
reached, calls on its keys are logged misses (and ``False`` from ``put``) and
that master is not tried again for ``backoff`` seconds, while the other masters
keep serving. After a replica takes its slots over (or the master returns) the
client's slot map is refreshed on the next failure and calls succeed again.
When no node can be reached at all, the whole store waits ``backoff`` seconds,
as a single server's does. Run the masters with
``cluster-require-full-coverage no`` so that they keep serving while one of
them is down (``scripts/redis-cluster.sh`` does).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Sequence
from urllib.parse import unquote

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError, RedisClusterException, TryAgainError

from kvtool.errors import UsageError
from kvtool.store.redis import EVERYWHERE, Group, RedisStore
from kvtool.store.redis_wire import UnbufferedConnection

DEFAULT_PORT = 6379


class RedisClusterStore(RedisStore):
    scheme = "redis+cluster"
    _whole = "the cluster"

    def _open_client(self, base: str, options: dict[str, Any]) -> None:
        scheme, nodes, credentials = parse_cluster_url(base, self._base)
        tls = scheme.startswith("rediss")
        (host, port), *others = nodes
        self._options = {
            **options,
            **credentials,
            # Given a URL, redis-py builds each node's connection pool from these options, so
            # the connection class applies (rediss:// makes it redis-py's TLS connection).
            "url": f"{'rediss' if tls else 'redis'}://{f'[{host}]' if ':' in host else host}:{port}",
            "startup_nodes": [ClusterNode(host, port) for host, port in others],
            "require_full_coverage": False,  # a master down leaves the others serving
            **({} if tls else {"connection_class": UnbufferedConnection}),
        }
        self._cluster: RedisCluster | None = None
        self._connect_lock = threading.Lock()

    @property
    def _client(self) -> RedisCluster:
        """The cluster client, made on first use: making it asks a node for the slot map."""
        with self._connect_lock:
            if self._cluster is None:
                self._cluster = RedisCluster(**self._options)
            return self._cluster

    def _close(self) -> None:
        with self._connect_lock:
            if self._cluster is not None:
                self._cluster.close()

    def _failures(self) -> tuple[type[BaseException], ...]:
        return (redis.RedisError, RedisClusterException, OSError)

    def _tripped(self, scope: str, exc: BaseException) -> str:
        """A node failed: ask the others for the slot map, so its slots go to a promoted replica
        as soon as there is one. When no node answers, the whole cluster is down."""
        if isinstance(exc, RedisClusterException) or self._cluster is None:
            return EVERYWHERE
        try:
            self._cluster.nodes_manager.initialize()
        except (redis.RedisError, RedisClusterException, OSError):
            return EVERYWHERE
        return scope

    def _scope(self, key: str) -> str:
        if self._cluster is None:
            return EVERYWHERE  # the call itself makes the client, or trips the whole store's breaker
        try:
            node_name: str = self._cluster.get_node_from_key(self._k(key)).name
            return node_name
        except (redis.RedisError, RedisClusterException, OSError):
            return EVERYWHERE  # no slot map yet, or it lacks the slot: the call will tell

    def _groups(self, keys: Sequence[str]) -> list[Group]:
        if not keys:
            return []
        client = self._client
        by_node: dict[str, Any] = {}
        slots: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        for i, key in enumerate(keys):
            raw = self._k(key)
            node = client.get_node_from_key(raw)
            by_node[node.name] = node
            slots[node.name][client.keyslot(raw)].append(i)
        return [
            Group(name, client.get_redis_connection(node), list(slots[name].values())) for name, node in by_node.items()
        ]

    def _servers(self) -> list[tuple[str, Any]]:
        client = self._client
        return [(node.name, client.get_redis_connection(node)) for node in client.get_primaries()]

    def _server_of(self, key: str) -> Any:
        client = self._client
        return client.get_redis_connection(client.get_node_from_key(self._k(key)))

    def _redirected(self, exc: Exception) -> bool:
        if isinstance(exc, (AskError, TryAgainError)):  # MOVED is an AskError in redis-py
            self._client.nodes_manager.initialize()
            return True
        return False


def parse_cluster_url(base: str, shown: str) -> tuple[str, list[tuple[str, int]], dict[str, str]]:
    """``(scheme, [(host, port), ...], {"username": ..., "password": ...})`` of a cluster URL without its query.

    ``shown`` is the URL with its password masked, for messages.
    """
    scheme, sep, rest = base.partition("://")
    netloc, _, path = rest.partition("/")
    if not sep or path not in ("", "0"):
        raise UsageError(f"bad cluster URL {shown!r}: a Redis Cluster has only database 0 "
                         "(redis+cluster://host:port,host:port/?options)")
    userinfo, at, hosts = netloc.rpartition("@")
    credentials: dict[str, str] = {}
    if at:
        user, colon, password = userinfo.partition(":")
        if user:
            credentials["username"] = unquote(user)
        if colon and password:
            credentials["password"] = unquote(password)
    nodes = [_host_port(part.strip(), shown) for part in hosts.split(",")]
    return scheme.lower(), nodes, credentials


def _host_port(text: str, shown: str) -> tuple[str, int]:
    host, port = text, ""
    if text.startswith("["):  # [IPv6]:port
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    elif ":" in text:
        host, _, port = text.rpartition(":")
    if not host or not (port == "" or port.isdigit() and 0 < int(port) < 65536):
        raise UsageError(f"bad node {text!r} in cluster URL {shown!r}: expected host:port")
    return host, int(port or DEFAULT_PORT)
