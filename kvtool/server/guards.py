"""What every request passes before it reaches an endpoint: rate, token, size.

Plain ASGI middleware, outermost first: ``RateGuard`` (a token bucket per
client: its address, or the unix socket), ``AuthGuard`` (the bearer token, on
every path but the open ones), ``BodyGuard`` (request bodies bounded, by their
``Content-Length`` and by what actually arrives). A refused request never
reaches the store. Every refusal is ``{"error": {"code", "message"}}`` with a
stable code (``ERROR_CODES``).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable, MutableMapping, Sequence

from kvtool.server.auth import token_matches

ERROR_CODES = {
    "invalid_request": 422,
    "unauthorized": 401,
    "not_found": 404,
    "method_not_allowed": 405,
    "pinned": 409,
    "payload_too_large": 413,
    "rate_limited": 429,
    "internal": 500,
    "unavailable": 503,
    "not_stored": 507,
}

# The ASGI types as Starlette declares them.
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def error_body(code: str, message: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": message}}).encode()


async def send_error(send: Send, code: str, message: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = error_body(code, message)
    await send({
        "type": "http.response.start",
        "status": ERROR_CODES[code],
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
    })
    await send({"type": "http.response.body", "body": body})


class AuthGuard:
    """Requests outside ``open_paths`` need ``Authorization: Bearer <token>``."""

    def __init__(self, app: App, token: str, open_paths: frozenset[str], on_refused: Callable[[], None]) -> None:
        self.app, self.token, self.open_paths, self.on_refused = app, token, open_paths, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not token_matches(header, self.token):
                self.on_refused()
                await send_error(send, "unauthorized", "missing or wrong bearer token",
                                 [(b"www-authenticate", b'Bearer realm="kvtool"')])
                return
        await self.app(scope, receive, send)


class BodyGuard:
    """Request bodies of at most ``limit_for(path)`` bytes.

    A body with a ``Content-Length`` is judged by it (the HTTP server delivers
    no more than it declares); a chunked body is read here, up to the limit,
    before the endpoint sees it.
    """

    def __init__(self, app: App, limit_for: Callable[[str], int]) -> None:
        self.app, self.limit_for = app, limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > limit:
                return await send_error(send, "payload_too_large", f"request bodies here are at most {limit} bytes")
            return await self.app(scope, receive, send)
        messages, received = [], 0
        while True:
            message = await receive()
            messages.append(message)
            received += len(message.get("body", b""))
            if received > limit:
                return await send_error(send, "payload_too_large", f"request bodies here are at most {limit} bytes")
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


class RateGuard:
    """At most ``rate`` requests a second per client, in bursts of up to ``burst``; off when ``rate`` is 0."""

    def __init__(self, app: App, rate: float, burst: int, on_refused: Callable[[], None], max_clients: int = 10_000) -> None:
        self.app, self.rate, self.burst, self.on_refused = app, rate, max(burst, 1), on_refused
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, last refill)
        self._max_clients = max_clients
        self._lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.rate > 0 and not self._take(_client(scope)):
            self.on_refused()
            retry = max(1, round(1 / self.rate))
            return await send_error(send, "rate_limited", f"more than {self.rate:g} requests a second",
                                    [(b"retry-after", str(retry).encode())])
        await self.app(scope, receive, send)

    def _take(self, client: str) -> bool:
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.pop(client, (float(self.burst), now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            allowed = tokens >= 1
            self._buckets[client] = (tokens - 1 if allowed else tokens, now)
            while len(self._buckets) > self._max_clients:
                self._buckets.popitem(last=False)
        return allowed


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return "unix" if not client else str(client[0])
