"""The redis tier: records in a Redis server, shared by every process that uses it.

``redis://[[user]:password@]host:6379/0?ttl=3600&timeout=1&prefix=kvtool:``
(``rediss://`` for TLS). The password comes from the URL or, when the URL has
none, from the environment variable ``KVTOOL_REDIS_PASSWORD``; it never appears
in ``repr``, messages or logs. ``kvtool.store.redis_cluster`` is the same tier
over a Redis Cluster.

Options: ``ttl`` (seconds an entry lives after it is written; default 86400, a
day; ``ttl=none``: until Redis evicts it),
``timeout`` (socket timeout, seconds, default 1), ``connect_timeout`` (default
0.5), ``prefix`` (namespace for the keys, default ``kvtool:``), ``backoff``
(seconds to treat the server as down after a failure, default 1), and for TLS
``ssl_ca_certs`` and ``ssl_cert_reqs``, passed to redis-py.

The default TTL trades a recompute for bounded memory: a prefix unused for a day
is gone and computed again, but a Redis server left at its default
``maxmemory-policy noeviction`` never fills up with entries no one reads (once
full, every put fails). With ``ttl=none`` set ``maxmemory`` and
``maxmemory-policy allkeys-lru`` on the server, so Redis evicts the coldest.

Every failure (server down, timeout, a key Redis evicted, a damaged value) is a
miss, or ``False`` from ``put``, with the reason logged: a cache that cannot be
reached must never stop the caller. A write Redis refuses for lack of memory
(``OOM``: ``maxmemory`` reached under ``noeviction``, or its clients' buffers
filling the room) makes room among the store's own entries on that server and
is tried again (``kvtool.store.redis_room``); one still refused is counted in
``put_refused``, and ``stats()`` adds what the servers say of their memory and
of the writes they refused from every client. After a failure the store does not try the
server again for ``backoff`` seconds, so a dead server costs the caller one
timeout, not one per call (a circuit breaker).

Batch calls (``get_many``, ``put_many``, ``contains_many``) cost one round trip
per server, with one ``MGET`` per group of keys a server holds together; a key
whose command fails in the batch is asked again on its own, so each key
succeeds or fails by itself. Replies
are parsed by ``hiredis`` when it is installed (the ``redis`` extra installs
it); requests are packed by redis-py's own packer, which sends a large value as
its own buffer where hiredis' would first copy it into one command string.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar, cast

import redis
from redis.backoff import NoBackoff
from redis.exceptions import OutOfMemoryError
from redis.retry import Retry

from kvtool.errors import StoreUnreachableError, UsageError
from kvtool.store.base import Store, Value, log
from kvtool.store.entry import HEADER, MAX_KEY_BYTES, MAX_META_BYTES, EntryInfo, check_key, parse_info, wrap
from kvtool.store.redis_room import ROOM_TRIES, Room, make_room, server_memory
from kvtool.store.redis_wire import UnbufferedConnection
from kvtool.store.results import Fetched, MissCause
from kvtool.store.url import has_password, non_negative_seconds, parse_options, positive_seconds, redact, split_query

PASSWORD_ENV = "KVTOOL_REDIS_PASSWORD"
DEFAULT_PREFIX = "kvtool:"
DEFAULT_TTL = 86400.0  # seconds
_TLS_OPTIONS = ("ssl_ca_certs", "ssl_cert_reqs")  # passed to redis-py as they are
_INFO_PREFIX = HEADER.size + MAX_KEY_BYTES + MAX_META_BYTES

_CONSEQUENCE = {"get": "treated as a miss", "put": "not stored", "delete": "not deleted"}
EVERYWHERE = "*"  # the breaker scope that covers every server of a store

T = TypeVar("T")


@dataclass
class Group:
    """Keys one server answers in one round trip: ``batches`` are lists of indices into the
    caller's keys, one multi-key command each (keys of one hash slot in a cluster)."""

    scope: str  # the circuit breaker this server falls under
    client: Any  # a redis.Redis for that server
    batches: list[list[int]]

    @property
    def indices(self) -> list[int]:
        return [i for batch in self.batches for i in batch]


class RedisStore(Store):
    scheme = "redis"
    persistent = True
    shared = True
    typical_latency_s = 3e-4
    typical_bandwidth = 1e9
    _whole = "the server"  # what EVERYWHERE means, for log messages

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        ttl: float | None = DEFAULT_TTL,
        timeout: float = 1.0,
        connect_timeout: float = 0.5,
        prefix: str = DEFAULT_PREFIX,
        backoff: float = 1.0,
        tls: Mapping[str, str] | None = None,
        name: str | None = None,
    ) -> None:
        """``url`` names the server only; ``from_url`` reads the options from a URL's query."""
        super().__init__(capacity=None, name=name)
        base, query = split_query(url)
        self._base = redact(base)
        if query:
            raise UsageError(
                f"{type(self).__name__}({self._base!r}, ...) takes options as arguments; "
                f"{type(self).__name__}.from_url reads a query"
            )
        self.ttl = ttl
        self.prefix = prefix
        self.backoff = backoff
        self._down_until: dict[str, float] = {}
        self._rooms: dict[str, Room] = {}  # per server: where the sampling for room goes on
        self._state_lock = threading.Lock()
        password = None if has_password(base) else os.environ.get(PASSWORD_ENV)
        options: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": connect_timeout,
            "retry": Retry(NoBackoff(), 0),
            **({"password": password} if password else {}),
            **(tls or {}),
        }
        self._open_client(base, options)

    @classmethod
    def from_url(cls, url: str) -> "RedisStore":
        parsers: dict[str, Callable[[str], Any]] = {
            "ttl": _ttl,
            "timeout": positive_seconds,
            "connect_timeout": positive_seconds,
            "backoff": non_negative_seconds,
            "prefix": str,
        }
        options = parse_options(url, {**parsers, **{k: str for k in _TLS_OPTIONS}})
        tls = {k: options.pop(k) for k in _TLS_OPTIONS if k in options}
        return cls(split_query(url)[0], tls=tls, **options)

    def describe(self) -> str:
        options = {
            "ttl": None if self.ttl == DEFAULT_TTL else "none" if self.ttl is None else f"{self.ttl:g}",
            "prefix": self.prefix if self.prefix != DEFAULT_PREFIX else None,
        }
        query = "&".join(f"{k}={v}" for k, v in options.items() if v is not None)
        return self._base + ("?" + query if query else "")

    def check_reachable(self) -> None:
        try:  # a cluster client connects on first use, so listing its servers can fail too
            for _, client in self._servers():
                client.ping()
        except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
            raise StoreUnreachableError(f"cannot reach the redis store {self._base}{self._detail(exc)}") from None

    def _detail(self, exc: Exception) -> str:
        """redis-py's reason for a failure; only its type where the URL holds credentials it might quote."""
        return f" ({type(exc).__name__})" if "@" in self._base else f": {type(exc).__name__}: {exc}"

    # --- what differs between one server and a cluster ---------------------------

    def _open_client(self, base: str, options: dict[str, Any]) -> None:
        tls = base.lower().startswith("rediss:")
        database = base.partition("://")[2].rpartition("@")[2].partition("/")[2]  # credentials may hold a '/'
        if not (database == "" or database.isascii() and database.isdigit()):
            raise UsageError(f"bad redis URL {self._base!r}: the path names a database by number (redis://host:6379/0)")
        try:
            self._redis = redis.Redis.from_url(
                base, **options, **({} if tls else {"connection_class": UnbufferedConnection})
            )
        except ValueError as exc:
            raise UsageError(f"bad redis URL {self._base!r}{self._detail(exc)}") from None

    @property
    def _client(self) -> Any:
        """The client calls go through (a cluster's differs): ``redis.Redis`` here."""
        return self._redis

    def _scope(self, key: str) -> str:
        """The circuit breaker a call on ``key`` falls under: the server that holds it."""
        return EVERYWHERE

    def _groups(self, keys: Sequence[str]) -> list[Group]:
        return [Group(EVERYWHERE, self._client, [list(range(len(keys)))])] if keys else []

    def _servers(self) -> list[tuple[str, Any]]:
        """``(scope, client)`` of every server that holds keys, for ``keys()``."""
        return [(EVERYWHERE, self._client)]

    def _server_of(self, key: str) -> Any:
        """A client of the one server that holds ``key``."""
        return self._client

    def _redirected(self, exc: Exception) -> bool:
        """Whether a batch failed only because a key lives elsewhere now (a cluster's MOVED)."""
        return False

    # --- single-key hooks ---------------------------------------------------------

    def _read(self, key: str) -> bytes | None:
        record = self._read_result(key)
        return record if isinstance(record, bytes) else None

    def _read_result(self, key: str) -> bytes | Fetched:
        failed = object()
        record = self._call("get", key, lambda: self._client.get(self._k(key)), failed)
        if record is failed:
            where = self._where(EVERYWHERE if self._is_down(EVERYWHERE) else self._scope(key))
            return Fetched(key, None, MissCause.UNREACHABLE, f"{where} of {self._base} did not answer (see the log)")
        if record is None:
            return Fetched(key, None, MissCause.MISSING, "no such entry (never stored, deleted, expired or evicted)")
        return bytes(cast(bytes, record))  # no decode_responses: replies are bytes

    def _write(self, info: EntryInfo, record: bytes) -> bool:
        return self._call("put", info.key, lambda: self._set(info.key, record), False)

    def _set(self, key: str, record: bytes) -> bool:
        """SET; refused for lack of memory, make room on that server (a few times the record, more each try) and
        try again. A write still refused is counted and logged, and is no failure of the server."""
        for attempt in range(1, ROOM_TRIES + 2):
            try:
                return bool(self._client.set(self._k(key), record, px=self._px))
            except OutOfMemoryError:
                if attempt > ROOM_TRIES or not self._make_room(key, (attempt + 1) * len(record)):
                    break
        self.metrics.count("put_refused")
        log.warning("%s: the server holding %r refused a %d-byte write for lack of memory, with no room to make "
                    "among this store's entries there; not stored", self.name, key, len(record))
        return False

    def _make_room(self, key: str, need: int) -> bool:
        """Evict this store's least recently used entries on the server holding ``key`` (about ``need`` bytes)."""
        scope = EVERYWHERE if self._is_down(EVERYWHERE) else self._scope(key)
        with self._state_lock:
            room = self._rooms.setdefault(scope, Room())
        gone, freed, made = make_room(self._server_of(key), _glob_escape(self.prefix) + "*", self._k(key), need, room)
        n = len(self.prefix.encode())
        self._evicted([k[n:].decode("utf-8", "replace") for k in gone], freed)
        return made

    def _delete(self, key: str) -> bool:
        return bool(self._call("delete", key, lambda: self._client.delete(self._k(key)), 0))

    def _contains(self, key: str) -> bool:
        return bool(self._call("contains", key, lambda: self._client.exists(self._k(key)), 0))

    def _keys(self) -> list[str]:
        pattern = _glob_escape(self.prefix) + "*"
        n = len(self.prefix.encode())
        found: dict[str, None] = {}  # ordered, and a key seen on two servers mid-migration counts once
        no_servers: list[tuple[str, Any]] = []
        for scope, client in self._call("keys", None, self._servers, no_servers, scope=EVERYWHERE):
            def scan(client: Any = client) -> list[str]:
                return [k[n:].decode("utf-8", "replace") for k in client.scan_iter(match=pattern, count=1000)]

            no_keys: list[str] = []
            found.update(dict.fromkeys(self._call("keys", None, scan, no_keys, scope=scope)))
        return list(found)

    def _info(self, key: str) -> EntryInfo | None:
        def head() -> tuple[int, bytes]:
            pipe = self._client.pipeline(transaction=False)
            pipe.strlen(self._k(key))
            pipe.getrange(self._k(key), 0, _INFO_PREFIX - 1)
            size, prefix = pipe.execute()
            return size, prefix

        size, prefix = self._call("info", key, head, (0, b""))
        return parse_info(prefix, size) if size else None

    def _close(self) -> None:
        self._client.close()

    # --- batches: one round trip per server ---------------------------------------

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        keys = _checked(keys)
        self._check_open()
        start = time.perf_counter()

        def queue(pipe: Any, batch: list[str]) -> None:
            pipe.mget([self._k(k) for k in batch])

        records = self._batched("get", keys, queue, lambda replies: [r for reply in replies for r in reply], self._read)
        elapsed = time.perf_counter() - start  # every key waited for the whole batch
        values: list[bytes | None] = []
        for key, record in zip(keys, records):
            entry = None if record is None else self._verified(key, bytes(record))
            if entry is None:
                self.metrics.miss(elapsed)
                values.append(None)
            else:
                self.metrics.hit(elapsed, entry.size)
                values.append(bytes(entry.value))
        return values

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        keys = _checked(keys)
        self._check_open()

        def queue(pipe: Any, batch: list[str]) -> None:
            for key in batch:
                pipe.exists(self._k(key))

        return [bool(n) for n in self._batched("contains", keys, queue, list, self._contains)]

    def put_many(self, items: Mapping[str, Value] | Iterable[tuple[str, Value]]) -> list[bool]:
        pairs = items.items() if isinstance(items, Mapping) else items
        entries = [wrap(key, value) for key, value in pairs]
        self._check_open()
        by_key = {entry.key: entry for entry in entries}  # the last value of a repeated key wins, as in a loop

        def queue(pipe: Any, batch: list[str]) -> None:
            for key in batch:
                pipe.set(self._k(key), by_key[key].record, px=self._px)

        def one(key: str) -> bool:
            return self._write(by_key[key], by_key[key].record)

        keys = list(by_key)
        stored = dict(zip(keys, (bool(ok) for ok in self._batched("put", keys, queue, list, one))))
        with self.events.delivering():
            for entry in entries:
                if not stored[entry.key]:
                    self.metrics.count("put_failures")
                    self._tier_event("failed", entry.key, f"write to {self.name} failed")
                elif by_key[entry.key] is entry:
                    self.metrics.stored(entry.size - entry.value_offset, entry.size)
                    self._tier_event("stored", entry.key)
        return [stored[entry.key] for entry in entries]

    def _batched(
        self,
        op: str,
        keys: list[str],
        queue: Callable[[Any, list[str]], None],
        flatten: Callable[[list[Any]], list[Any]],
        one: Callable[[str], Any],
    ) -> list[Any]:
        """Run ``op`` for ``keys`` with one pipeline per server; a key of a failed server gets None.

        ``queue`` adds the commands for one batch of keys to a pipeline,
        ``flatten`` turns the pipeline's replies into one result per key, and
        ``one`` does a single key (used when a cluster moved some keys).
        """
        results: list[Any] = [None] * len(keys)
        no_groups: list[Group] = []
        groups = self._call(op, f"<{len(keys)} keys>", lambda: self._groups(keys), no_groups, scope=EVERYWHERE)
        for group in groups:
            indices = group.indices

            def run(group: Group = group, indices: list[int] = indices) -> list[Any]:
                pipe = group.client.pipeline(transaction=False)
                for batch in group.batches:
                    queue(pipe, [keys[i] for i in batch])
                replies = pipe.execute(raise_on_error=False)
                failed = next((r for r in replies if isinstance(r, Exception)), None)
                if failed is None:
                    return flatten(replies)
                # A key moved elsewhere (a cluster's MOVED: the slot map is refreshed), a write refused for lack
                # of memory, or any other command's error: each key on its own, so that one fails alone.
                how = "redirected" if self._redirected(failed) else f"{type(failed).__name__}: {failed}"
                log.debug("%s: %s of %d keys in one batch failed (%s); asking key by key", self.name, op, len(indices),
                          how)
                return [one(keys[i]) for i in indices]

            replies = self._call(op, f"<{len(indices)} keys>", run, None, scope=group.scope)
            if replies is not None:
                for i, reply in zip(indices, replies):
                    results[i] = reply
        return results

    def stats(self) -> dict[str, Any]:
        """The store's stats, and what its servers say of their memory (``redis_room.server_memory``)."""
        data = super().stats()
        no_servers: list[tuple[str, Any]] = []
        servers = self._call("stats", None, self._servers, no_servers, scope=EVERYWHERE)
        unknown: dict[str, Any] = {}
        data.update(self._call("stats", None, lambda: server_memory(client for _, client in servers), unknown))
        return data

    # --- helpers --------------------------------------------------------------

    @property
    def _px(self) -> int | None:
        return None if self.ttl is None else max(1, int(self.ttl * 1000))

    def _k(self, key: str) -> bytes:
        return (self.prefix + key).encode()

    def _failures(self) -> tuple[type[BaseException], ...]:
        return (redis.RedisError, OSError)

    def _call(self, op: str, key: str | None, fn: Callable[[], T], on_failure: T, scope: str | None = None) -> T:
        """Run one Redis call; a failure is logged, trips the breaker of its scope and becomes ``on_failure``."""
        scope = scope or (EVERYWHERE if key is None or self._is_down(EVERYWHERE) else self._scope(key))
        if self._is_down(scope) or self._is_down(EVERYWHERE):
            log.debug("%s: %s %r skipped: %s failed less than %.1fs ago", self.name, op, key, self._where(scope), self.backoff)
            self.metrics.count("errors")
            return on_failure
        try:
            return fn()
        except self._failures() as exc:
            tripped = self._tripped(scope, exc)
            with self._state_lock:
                self._down_until[tripped] = time.monotonic() + self.backoff
            log.warning(
                "%s: %s %r failed (%s: %s); %s; %s is tried again after %.1fs",
                self.name, op, key, type(exc).__name__, exc, _CONSEQUENCE.get(op, "treated as absent"),
                self._where(tripped), self.backoff,
            )
            self.metrics.count("errors")
            return on_failure

    def _tripped(self, scope: str, exc: BaseException) -> str:
        """The scope a failure takes down (by default the one the call was made in)."""
        return scope

    def _is_down(self, scope: str) -> bool:
        with self._state_lock:
            return time.monotonic() < self._down_until.get(scope, 0.0)

    def _where(self, scope: str) -> str:
        return self._whole if scope == EVERYWHERE else f"node {scope}"


def _checked(keys: Sequence[str]) -> list[str]:
    keys = list(keys)
    for key in keys:
        check_key(key)
    return keys


def _ttl(text: str) -> float | None:
    """``ttl=none`` keeps entries until Redis evicts them; otherwise positive seconds."""
    return None if text.strip().lower() == "none" else positive_seconds(text)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
