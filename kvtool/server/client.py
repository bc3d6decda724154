"""A Python client for the kvtool API, over TCP or a unix socket.

>>> with ApiClient("unix:///run/user/1000/kvtool.sock") as api:          # doctest: +SKIP
...     hit = api.lookup(tokens, model="HuggingFaceTB/SmolLM2-135M-Instruct", salt="tenant-42")
...     api.hint(hit["keys"], returns_in_s=30, offload=True, prefetch_ahead_s=2)

Calls that act on entries take ``keys`` or ``prefix`` (the fields of a
lookup) and return the server's per-key answer. Every refusal raises
``ApiError`` with the server's stable ``code`` (``unauthorized``,
``rate_limited``, ...), or ``unreachable`` when there is no server.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from kvtool.errors import KvtoolError, UnavailableError, UsageError
from kvtool.server.auth import DEFAULT_LISTEN, load_token

if TYPE_CHECKING:
    from typing_extensions import Self

API_ENV = "KVTOOL_API"
DEFAULT_URL = f"http://{DEFAULT_LISTEN}"

try:
    import httpx
except ImportError:  # pragma: no cover - reported when a client is made
    httpx = None  # type: ignore[assignment]


class ApiError(KvtoolError):
    """The API refused a call (``code`` and ``status`` are the server's) or could not be reached."""

    exit_code = 5

    def __init__(self, code: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


class ApiClient:
    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        token_file: Path | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        if httpx is None:
            raise UnavailableError("the kvtool API client needs httpx: pip install 'kvtool[api]'")
        self.url = url or os.environ.get(API_ENV) or DEFAULT_URL
        self._token = token
        self._token_file = token_file
        if self.url.startswith("unix:"):
            path = self.url[len("unix:"):].removeprefix("//")
            transport = httpx.HTTPTransport(uds=path)
            base = "http://kvtool"
        elif self.url.startswith(("http://", "https://")):
            transport, base = None, self.url.rstrip("/")
        else:
            raise UsageError(f"API URL {self.url!r}: write http://HOST:PORT, https://HOST:PORT or unix:///PATH")
        self._http = httpx.Client(base_url=base, transport=transport, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- reading ---------------------------------------------------------------------------

    def health(self) -> dict:
        return self._call("GET", "/v1/health", auth=False)

    def stats(self) -> dict:
        return self._call("GET", "/v1/stats")

    def entries(self, tier: str | None = None, offset: int = 0, limit: int = 1000) -> dict:
        params = {"offset": offset, "limit": limit} | ({} if tier is None else {"tier": tier})
        return self._call("GET", "/v1/entries", params=params)

    def entry(self, key: str) -> dict:
        return self._call("GET", "/v1/entry", params={"key": key})

    def get(self, key: str) -> bytes | None:
        """The entry's bytes, or None if there is none."""
        try:
            return self._call("GET", "/v1/entry/value", params={"key": key}, raw=True)
        except ApiError as exc:
            if exc.code == "not_found":
                return None
            raise

    def put(self, key: str, value: bytes, tokens: int | None = None) -> dict:
        params = {"key": key} | ({} if tokens is None else {"tokens": tokens})
        return self._call("PUT", "/v1/entry/value", params=params, content=bytes(value),
                          headers={"content-type": "application/octet-stream"})

    def lookup(self, tokens: Sequence[int], **fields: Any) -> dict:
        """The stored prefix of ``tokens``; ``fields`` as ``PrefixQuery`` (model, salt, recipe, ...).

        The answer gains ``keys``: every key of the stored chunks, in order.
        """
        result = self._call("POST", "/v1/lookup", json=_query(tokens, fields))
        result["keys"] = [key for chunk in result["chunks"] for key in chunk["keys"]]
        return result

    def metrics(self) -> str:
        return self._call("GET", "/metrics", auth=False, raw=True).decode()

    def openapi(self) -> dict:
        return self._call("GET", "/openapi.json", auth=False)

    def events(self, last_event_id: int | None = None) -> Iterator[dict]:
        """Server-sent events as ``{"id", "event", "data"}``, until the server ends the stream."""
        headers = self._auth_headers() | ({} if last_event_id is None else {"last-event-id": str(last_event_id)})
        try:
            with self._http.stream("GET", "/v1/events", headers=headers, timeout=httpx.Timeout(None)) as response:
                if response.status_code != 200:
                    response.read()
                    raise _refusal(response)
                yield from _parse_events(response.iter_lines())
        except httpx.TransportError as exc:
            raise ApiError("unreachable", f"kvtool API at {self.url}: {exc}") from None

    # --- scheduling --------------------------------------------------------------------------

    def pin(self, keys: Sequence[str] | None = None, prefix: dict | None = None) -> dict:
        return self._act("pin", keys, prefix)

    def unpin(self, keys: Sequence[str] | None = None, prefix: dict | None = None) -> dict:
        return self._act("unpin", keys, prefix)

    def evict(self, keys: Sequence[str] | None = None, prefix: dict | None = None) -> dict:
        return self._act("evict", keys, prefix)

    def touch(self, keys: Sequence[str] | None = None, prefix: dict | None = None) -> dict:
        return self._act("touch", keys, prefix)

    def offload(self, keys: Sequence[str] | None = None, prefix: dict | None = None, to: str | int = -1) -> dict:
        return self._act("offload", keys, prefix, to=to)

    def prefetch(self, keys: Sequence[str] | None = None, prefix: dict | None = None, wait: bool = False) -> dict:
        return self._act("prefetch", keys, prefix, wait=wait)

    def hint(
        self,
        keys: Sequence[str] | None = None,
        prefix: dict | None = None,
        *,
        returns_in_s: float | None,
        offload: bool = False,
        prefetch_ahead_s: float | None = None,
    ) -> dict:
        """The entries are needed again in ``returns_in_s`` seconds, not before (None forgets the hint)."""
        return self._act("hint", keys, prefix, returns_in_s=returns_in_s, offload=offload,
                         prefetch_ahead_s=prefetch_ahead_s)

    # --- plumbing ------------------------------------------------------------------------------

    def _act(self, action: str, keys: Sequence[str] | None, prefix: dict | None, **options: Any) -> dict:
        body: dict[str, Any] = dict(options)
        if keys is not None:
            body["keys"] = list(keys)
        if prefix is not None:
            body["prefix"] = _query(prefix["tokens"], {k: v for k, v in prefix.items() if k != "tokens"})
        return self._call("POST", f"/v1/{action}", json=body)

    def _auth_headers(self) -> dict[str, str]:
        if self._token is None:
            self._token = load_token(self._token_file)
        return {"authorization": f"Bearer {self._token}"}

    def _call(self, method: str, path: str, auth: bool = True, raw: bool = False, headers: dict | None = None,
              **kwargs: Any) -> Any:
        all_headers = (self._auth_headers() if auth else {}) | (headers or {})
        try:
            response = self._http.request(method, path, headers=all_headers, **kwargs)
        except httpx.TransportError as exc:
            raise ApiError("unreachable", f"kvtool API at {self.url}: {exc or type(exc).__name__}") from None
        if response.status_code >= 400:
            raise _refusal(response)
        return response.content if raw else response.json()


def _query(tokens: Sequence[int], fields: dict[str, Any]) -> dict[str, Any]:
    return {"tokens": [int(t) for t in tokens], **{k: v for k, v in fields.items() if v is not None}}


def _refusal(response: "httpx.Response") -> ApiError:
    try:
        error = response.json()["error"]
        return ApiError(error["code"], f"kvtool API: {error['message']} ({error['code']})", response.status_code)
    except (ValueError, KeyError, TypeError):
        return ApiError("http_error", f"kvtool API answered HTTP {response.status_code}", response.status_code)


def _parse_events(lines: Iterator[str]) -> Iterator[dict]:
    event: dict[str, Any] = {}
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield {"id": int(event["id"]) if "id" in event else None, "event": event.get("event", "message"),
                       "data": json.loads("\n".join(data))}
            event, data = {}, []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                data.append(value)
            else:
                event[name] = value
