"""The redis tier: records in a Redis server, shared by every process that uses it.

``redis://[[user]:password@]host:6379/0?ttl=3600&timeout=1&prefix=kvtool:``
(``rediss://`` for TLS). The password comes from the URL or, when the URL has
none, from the environment variable ``KVTOOL_REDIS_PASSWORD``; it never appears
in ``repr``, messages or logs.

Options: ``ttl`` (seconds an entry lives; default: until Redis evicts it),
``timeout`` (socket timeout, seconds, default 1), ``connect_timeout`` (default
0.5), ``prefix`` (namespace for the keys, default ``kvtool:``), ``backoff``
(seconds to treat the server as down after a failure, default 1), and for TLS
``ssl_ca_certs`` and ``ssl_cert_reqs``, passed to redis-py.

Every failure (server down, timeout, a key Redis evicted, a damaged value) is a
miss, or ``False`` from ``put``, with the reason logged: a cache that cannot be
reached must never stop the caller. After a failure the store does not try the
server again for ``backoff`` seconds, so a dead server costs the caller one
timeout, not one per call.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Mapping, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtool.errors import StoreUnreachableError, UsageError
from kvtool.store.base import Store, log
from kvtool.store.entry import HEADER, MAX_KEY_BYTES, MAX_META_BYTES, EntryInfo, parse_info
from kvtool.store.url import has_password, parse_options, positive_seconds, redact, split_query

PASSWORD_ENV = "KVTOOL_REDIS_PASSWORD"
DEFAULT_PREFIX = "kvtool:"
_TLS_OPTIONS = ("ssl_ca_certs", "ssl_cert_reqs")  # passed to redis-py as they are
_INFO_PREFIX = HEADER.size + MAX_KEY_BYTES + MAX_META_BYTES

_CONSEQUENCE = {"get": "treated as a miss", "put": "not stored", "delete": "not deleted"}

T = TypeVar("T")


class RedisStore(Store):
    scheme = "redis"
    persistent = True
    shared = True
    typical_latency_s = 3e-4
    typical_bandwidth = 1e9

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        ttl: float | None = None,
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
            raise UsageError(f"RedisStore({self._base!r}, ...) takes options as arguments; RedisStore.from_url reads a query")
        self.ttl = ttl
        self.prefix = prefix
        self.backoff = backoff
        password = None if has_password(base) else os.environ.get(PASSWORD_ENV)
        try:
            self._client = redis.Redis.from_url(
                base,
                socket_timeout=timeout,
                socket_connect_timeout=connect_timeout,
                retry=Retry(NoBackoff(), 0),
                **({"password": password} if password else {}),
                **(tls or {}),
            )
        except ValueError as exc:
            raise UsageError(f"bad redis URL {self._base!r}{self._detail(exc)}") from None
        self._down_until = 0.0
        self._state_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str) -> "RedisStore":
        parsers: dict[str, Callable[[str], Any]] = {
            "ttl": positive_seconds,
            "timeout": positive_seconds,
            "connect_timeout": positive_seconds,
            "backoff": float,
            "prefix": str,
        }
        options = parse_options(url, {**parsers, **{k: str for k in _TLS_OPTIONS}})
        tls = {k: options.pop(k) for k in _TLS_OPTIONS if k in options}
        return cls(split_query(url)[0], tls=tls, **options)

    def describe(self) -> str:
        options = {
            "ttl": f"{self.ttl:g}" if self.ttl else None,
            "prefix": self.prefix if self.prefix != DEFAULT_PREFIX else None,
        }
        query = "&".join(f"{k}={v}" for k, v in options.items() if v is not None)
        return self._base + ("?" + query if query else "")

    def check_reachable(self) -> None:
        try:
            self._client.ping()
        except (redis.RedisError, OSError) as exc:
            raise StoreUnreachableError(f"cannot reach the redis store {self._base}{self._detail(exc)}") from None

    # --- hooks ----------------------------------------------------------------

    def _read(self, key: str) -> bytes | None:
        record = self._call("get", key, lambda: self._client.get(self._k(key)), None)
        return None if record is None else bytes(record)

    def _write(self, info: EntryInfo, record: bytes) -> bool:
        px = None if self.ttl is None else max(1, int(self.ttl * 1000))
        return bool(self._call("put", info.key, lambda: self._client.set(self._k(info.key), record, px=px), False))

    def _delete(self, key: str) -> bool:
        return bool(self._call("delete", key, lambda: self._client.delete(self._k(key)), 0))

    def _contains(self, key: str) -> bool:
        return bool(self._call("contains", key, lambda: self._client.exists(self._k(key)), 0))

    def _keys(self) -> list[str]:
        pattern = _glob_escape(self.prefix) + "*"

        def scan() -> list[str]:
            n = len(self.prefix.encode())
            return [k[n:].decode("utf-8", "replace") for k in self._client.scan_iter(match=pattern, count=1000)]

        return self._call("keys", None, scan, [])

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

    # --- helpers --------------------------------------------------------------

    def _detail(self, exc: Exception) -> str:
        """redis-py's reason for a failure; only its type where the URL holds credentials it might quote."""
        return f" ({type(exc).__name__})" if "@" in self._base else f": {type(exc).__name__}: {exc}"

    def _k(self, key: str) -> bytes:
        return (self.prefix + key).encode()

    def _call(self, op: str, key: str | None, fn: Callable[[], T], on_failure: T) -> T:
        """Run one Redis call; a failure is logged and becomes ``on_failure``."""
        with self._state_lock:
            down = time.monotonic() < self._down_until
        if down:
            log.debug("%s: %s %r skipped: the server failed less than %.1fs ago", self.name, op, key, self.backoff)
            self.metrics.count("errors")
            return on_failure
        try:
            return fn()
        except (redis.RedisError, OSError) as exc:
            with self._state_lock:
                self._down_until = time.monotonic() + self.backoff
            log.warning(
                "%s: %s %r failed (%s: %s); %s; the server is tried again after %.1fs",
                self.name, op, key, type(exc).__name__, exc, _CONSEQUENCE.get(op, "treated as absent"), self.backoff,
            )
            self.metrics.count("errors")
            return on_failure


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
