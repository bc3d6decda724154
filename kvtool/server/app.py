"""The HTTP API over a ``TieredStore``: the hot/cold scheduling calls, lookups, events and metrics.

``create_app`` returns an ASGI application; ``kvtool.server.run`` serves it.
Entries are named by keys in query strings and JSON bodies, never by paths, so
no request can reach a file outside the store. Calls that act on entries take
``keys`` or a ``prefix`` (a prompt, resolved to the keys of its stored
chunks exactly as ``/v1/lookup`` resolves it) and answer per key.

Store calls block (a file tier, Redis), so the endpoints that make them are
plain functions, which FastAPI runs in its thread pool.
"""

from __future__ import annotations

import logging
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Union

from fastapi import APIRouter, FastAPI, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field, StringConstraints
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvtool
from kvtool.errors import KvtoolError, UnavailableError, UsageError
from kvtool.server.events import EventHub, TooManyListeners
from kvtool.server.guards import ERROR_CODES, AuthGuard, BodyGuard, RateGuard, error_body
from kvtool.server.later import Later
from kvtool.server.lookup import BlockHasher, LookupResult, PrefixQuery, lookup_prefix
from kvtool.server.metrics import ApiMetrics
from kvtool.store import StoreClosedError, TieredStore
from kvtool.store.entry import check_key
from kvtool.store.policy import HintedPolicy

log = logging.getLogger("kvtool.server")

MAX_KEYS = 4096  # per request
OPEN_PATHS = frozenset({"/v1/health", "/metrics", "/openapi.json"})


@dataclass(frozen=True)
class Limits:
    """Bounds on what clients may ask: body sizes, request rate per client, open event streams."""

    max_json_bytes: int = 8 << 20  # a lookup of MAX_TOKENS token ids fits
    max_value_bytes: int = 256 << 20
    rate: float = 1000.0  # requests a second per client; 0 turns the limit off
    burst: int = 2000
    max_event_streams: int = 64
    prefetch_wait_s: float = 60.0


@dataclass
class ApiContext:
    """What the endpoints share."""

    store: TieredStore
    policy: HintedPolicy
    hub: EventHub
    later: Later
    lookup_defaults: dict[str, Any] = field(default_factory=dict)
    block_hasher: BlockHasher | None = None


# --- request and response bodies ---------------------------------------------------------

Key = Annotated[str, StringConstraints(min_length=1, max_length=1024)]


class ErrorDetail(BaseModel):
    code: str = Field(description="stable, one of: " + ", ".join(ERROR_CODES))
    message: str


class ErrorBody(BaseModel):
    error: ErrorDetail


class Selection(BaseModel):
    """The entries to act on: ``keys``, or the stored chunks of a prompt (``prefix``, as for /v1/lookup)."""

    keys: list[Key] | None = Field(None, max_length=MAX_KEYS)
    prefix: PrefixQuery | None = None


class OffloadBody(Selection):
    to: Union[str, int] = Field(-1, description="tier name or number (0 is the fastest, -1 the slowest)")


class PrefetchBody(Selection):
    wait: bool = Field(False, description="answer when the entries are in the fastest tier (or after the server's wait limit)")


class HintBody(Selection):
    returns_in_s: float | None = Field(
        ..., ge=0, le=7 * 86400, description="seconds until the entries are needed again, not before; null forgets the hint"
    )
    offload: bool = Field(False, description="move the entries to the slowest tier now")
    prefetch_ahead_s: float | None = Field(
        None, ge=0, le=86400, description="prefetch them this many seconds before they are due"
    )


class KeyResult(BaseModel):
    key: str
    ok: bool
    status: str = Field(description="what happened: pinned, unpinned, not_pinned, evicted, moved, refused, "
                                    "queued, in_top_tier, not_moved, pending, touched, hinted, missing")
    tier: str | None = Field(None, description="the tier holding the entry afterwards")


class BatchResult(BaseModel):
    results: list[KeyResult]
    ok: int = Field(description="how many keys succeeded")


class EntryRow(BaseModel):
    key: str
    tier: str | None
    bytes: int
    tokens: int | None
    pinned: bool
    due_in_s: float | None = Field(description="seconds until a hint says the entry is needed; null without a hint")


class EntryDetail(EntryRow):
    meta: dict[str, Any]


class EntryList(BaseModel):
    entries: list[EntryRow]
    total: int
    offset: int


class Stored(BaseModel):
    key: str
    tier: str | None


class Health(BaseModel):
    status: str
    version: str


# --- the application -----------------------------------------------------------------------

def create_app(
    store: TieredStore,
    token: str,
    limits: Limits = Limits(),
    lookup_defaults: dict[str, Any] | None = None,
    block_hasher: BlockHasher | None = None,
) -> "ApiApp":
    """The API over ``store``; its policy is wrapped in a ``HintedPolicy`` so hints reach it.

    ``lookup_defaults`` fill the fields a lookup leaves out (the vLLM connector
    passes its model, recipe and block size); ``block_hasher`` is vLLM's own,
    when the API runs inside vLLM.
    """
    if not isinstance(store.policy, HintedPolicy):
        store.policy = HintedPolicy(store.policy)
    ctx = ApiContext(store, store.policy, EventHub(max_listeners=limits.max_event_streams), Later(),
                     dict(lookup_defaults or {}), block_hasher)
    unsubscribe = store.subscribe(ctx.hub.publish_store_event)

    api = FastAPI(
        title="kvtool API",
        version=kvtool.__version__,
        summary="Hot/cold scheduling of a kvtool KV cache store: pin, prefetch, offload, evict, hint, look up.",
        docs_url=None,
        redoc_url=None,
    )
    _add_error_handlers(api)
    api.include_router(_open_routes(ctx))
    api.include_router(_authenticated_routes(ctx, limits))
    api.openapi = lambda: _openapi_with_security(api)  # type: ignore[method-assign]  # FastAPI's documented way to customise the schema

    metrics = ApiMetrics(store, lambda: {"event_streams": ctx.hub.listeners, "scheduled_prefetches": ctx.later.pending()})
    api.state.metrics = metrics

    def limit_for(path: str) -> int:
        return limits.max_value_bytes if path == "/v1/entry/value" else limits.max_json_bytes

    guarded = RateGuard(
        AuthGuard(BodyGuard(api, limit_for), token, OPEN_PATHS, metrics.refused.labels("unauthorized").inc),
        limits.rate, limits.burst, metrics.refused.labels("rate_limited").inc,
    )

    def close() -> None:
        unsubscribe()
        ctx.later.close()
        ctx.hub.close()

    return ApiApp(metrics.wrap(guarded), api, ctx, close)


@dataclass
class ApiApp:
    """The ASGI application to serve, the FastAPI app inside it (for its schema), and how to stop it.

    ``close`` ends the event streams and drops scheduled prefetches; the store
    stays open (its owner closes it).
    """

    asgi: Callable
    fastapi: FastAPI
    context: ApiContext
    close: Callable[[], None]

    async def __call__(self, scope, receive, send) -> None:
        await self.asgi(scope, receive, send)


def _open_routes(ctx: ApiContext) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/health", response_model=Health, tags=["server"])
    def health() -> Health:
        """Is the server up? Needs no token."""
        return Health(status="ok", version=kvtool.__version__)

    @router.get("/metrics", response_class=PlainTextResponse, tags=["server"],
                responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
    def metrics(request: Request) -> Response:
        """Prometheus metrics: entries, bytes, hits, evictions and moves per tier; API requests. Needs no token."""
        return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return router


def _authenticated_routes(ctx: ApiContext, limits: Limits) -> APIRouter:
    errors: dict[int | str, dict[str, Any]] = {status: {"model": ErrorBody} for status in (401, 413, 422, 429, 500, 503)}
    router = APIRouter(prefix="/v1", responses=errors)
    store = ctx.store

    @router.get("/stats", tags=["store"])
    def stats() -> dict[str, Any]:
        """What the store holds and has done, per tier, and the API's own state."""
        data = store.stats()
        data["api"] = {"event_streams": ctx.hub.listeners, "scheduled_prefetches": ctx.later.pending()}
        return data

    @router.get("/entries", response_model=EntryList, tags=["store"])
    def entries(
        tier: Annotated[str | None, Query(description="only entries in this tier")] = None,
        offset: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> EntryList:
        """The entries, coldest first within each tier, a page at a time."""
        if tier is not None and tier not in store.tier_names:
            raise UsageError(f"no tier {tier!r}; tiers: {', '.join(store.tier_names)}")
        keys = store.keys()
        if tier is not None:
            keys = [key for key in keys if store.tier_of(key) == tier]
        rows = [row for row in (_row(ctx, key) for key in keys[offset:offset + limit]) if row is not None]
        return EntryList(entries=rows, total=len(keys), offset=offset)

    @router.get("/entry", response_model=EntryDetail, responses={404: {"model": ErrorBody}}, tags=["store"])
    def entry(key: Annotated[Key, Query()]) -> EntryDetail:
        """One entry's tier, size, metadata, pin and hint."""
        row = _row(ctx, key, with_meta=True)
        if row is None:
            raise _NotFound(key)
        assert isinstance(row, EntryDetail)  # with_meta gives the detail
        return row

    @router.get("/entry/value", response_class=Response, tags=["store"],
                responses={200: {"content": {"application/octet-stream": {}}}, 404: {"model": ErrorBody}})
    def get_value(key: Annotated[Key, Query()]) -> Response:
        """The entry's bytes, verified; a hit below the top is promoted as any read is."""
        found = store.get_entry(key)
        if found is None:
            raise _NotFound(key)
        return Response(bytes(found.value), media_type="application/octet-stream")

    @router.put("/entry/value", response_model=Stored, tags=["store"],
                openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": {}}}},
                responses={507: {"model": ErrorBody}})
    async def put_value(
        request: Request,
        key: Annotated[Key, Query()],
        tokens: Annotated[int | None, Query(ge=0, description="tokens of KV cache the value holds")] = None,
    ) -> Stored:
        """Store the request body under ``key`` (replacing any old value)."""
        check_key(key)
        value = await request.body()
        meta = {} if tokens is None else {"tokens": tokens}
        if not await run_in_threadpool(store.put, key, value, meta):
            raise _NotStored(key)
        return Stored(key=key, tier=await run_in_threadpool(store.tier_of, key))

    @router.post("/lookup", response_model=LookupResult, tags=["scheduling"])
    def lookup(query: PrefixQuery) -> LookupResult:
        """How many tokens of a prompt are stored, in which chunks and tiers (keyed as the writer keyed them)."""
        return _lookup(ctx, query)

    @router.post("/pin", response_model=BatchResult, tags=["scheduling"])
    def pin(body: Selection) -> BatchResult:
        """Keep entries where they are (or higher) until unpinned: no demotion, no eviction."""
        def one(key: str) -> tuple[bool, str]:
            if not store.pin(key):
                return False, "missing"
            ctx.hub.publish("pinned", {"key": key, "tier": store.tier_of(key)})
            return True, "pinned"
        return _each(ctx, body, one)

    @router.post("/unpin", response_model=BatchResult, tags=["scheduling"])
    def unpin(body: Selection) -> BatchResult:
        def one(key: str) -> tuple[bool, str]:
            if not store.unpin(key):
                return False, "not_pinned"
            ctx.hub.publish("unpinned", {"key": key, "tier": store.tier_of(key)})
            return True, "unpinned"
        return _each(ctx, body, one)

    @router.post("/evict", response_model=BatchResult, tags=["scheduling"])
    def evict(body: Selection) -> BatchResult:
        """Remove entries from every tier; pinned entries are left alone."""
        def one(key: str) -> tuple[bool, str]:
            if store.is_pinned(key):
                return False, "pinned"
            try:
                return (True, "evicted") if store.evict(key) else (False, "missing")
            except UsageError:  # pinned in the meantime
                return False, "pinned"
        return _each(ctx, body, one)

    @router.post("/touch", response_model=BatchResult, tags=["scheduling"])
    def touch(body: Selection) -> BatchResult:
        """Mark entries as just used, without reading them."""
        return _each(ctx, body, lambda key: (True, "touched") if store.touch(key) else (False, "missing"))

    @router.post("/offload", response_model=BatchResult, tags=["scheduling"])
    def offload(body: OffloadBody) -> BatchResult:
        """Move entries down (or to any tier) now, e.g. when a session pauses; pinned entries stay."""
        _check_tier(store, body.to)
        return _each(ctx, body, lambda key: _offload(store, key, body.to))

    @router.post("/prefetch", response_model=BatchResult, tags=["scheduling"])
    def prefetch(body: PrefetchBody) -> BatchResult:
        """Bring entries to the fastest tier ahead of the request that needs them (in the background)."""
        keys = [key for key in _selected(ctx, body) if store.tier_of(key) is not None]
        futures = dict(zip(keys, store.prefetch(keys)))
        if body.wait:
            wait_for_futures(futures.values(), timeout=limits.prefetch_wait_s)

        def one(key: str) -> tuple[bool, str]:
            future = futures.get(key)
            if future is None:
                return False, "missing"
            if not body.wait:
                return True, "queued"
            if not future.done():
                return False, "pending"
            return (True, "in_top_tier") if future.result() else (False, "not_moved")
        return _each(ctx, body, one)

    @router.post("/hint", response_model=BatchResult, tags=["scheduling"])
    def hint(body: HintBody) -> BatchResult:
        """Say when entries are needed again (an agent's tool call returns in N seconds, not before).

        Until then they are the first to leave a full tier; close to then, the
        last. ``offload`` moves them down at once; ``prefetch_ahead_s``
        brings them back to the fastest tier that long before they are due.
        """
        return _each(ctx, body, lambda key: _hint(ctx, key, body))

    @router.get("/events", tags=["events"], response_class=StreamingResponse,
                responses={200: {"content": {"text/event-stream": {}}}})
    async def events(last_event_id: Annotated[int | None, Header(ge=0)] = None) -> StreamingResponse:
        """Server-sent events: stored, promoted, demoted, evicted, failed, pinned, unpinned, hinted, lost.

        Each event's ``data`` is JSON with the key and tiers. Reconnect with
        ``Last-Event-ID`` to receive what was missed, as far as the server
        still holds it (a ``lost`` event counts the rest).
        """
        try:
            stream = ctx.hub.open_stream(last_event_id)
        except TooManyListeners as exc:
            raise UnavailableError(str(exc)) from None
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router


# --- endpoint helpers ------------------------------------------------------------------------

def _lookup(ctx: ApiContext, query: PrefixQuery) -> LookupResult:
    return lookup_prefix(ctx.store, query.with_defaults(ctx.lookup_defaults), ctx.block_hasher)


def _selected(ctx: ApiContext, body: Selection) -> list[str]:
    if (body.keys is None) == (body.prefix is None):
        raise UsageError("give either 'keys' or 'prefix'")
    if body.keys is not None:
        keys = body.keys
    else:
        assert body.prefix is not None  # exactly one of the two, checked above
        keys = _lookup(ctx, body.prefix).keys
    for key in keys:
        check_key(key)
    return list(dict.fromkeys(keys))


def _each(ctx: ApiContext, body: Selection, action: Callable[[str], tuple[bool, str]]) -> BatchResult:
    results = []
    for key in _selected(ctx, body):
        ok, status = action(key)
        results.append(KeyResult(key=key, ok=ok, status=status, tier=ctx.store.tier_of(key)))
    return BatchResult(results=results, ok=sum(r.ok for r in results))


def _row(ctx: ApiContext, key: str, with_meta: bool = False) -> EntryRow | None:
    info = ctx.store.info(key)
    if info is None:
        return None
    fields: dict[str, Any] = dict(key=key, tier=ctx.store.tier_of(key), bytes=info.size, tokens=info.tokens,
                  pinned=ctx.store.is_pinned(key), due_in_s=ctx.policy.due_in(key))
    return EntryDetail(**fields, meta=info.meta) if with_meta else EntryRow(**fields)


def _check_tier(store: TieredStore, tier: str | int) -> None:
    n = len(store.tiers)
    if isinstance(tier, int) and not -n <= tier < n or isinstance(tier, str) and tier not in store.tier_names:
        raise UsageError(f"no tier {tier!r}; tiers: {', '.join(store.tier_names)} (or 0..{n - 1}, -1 for the slowest)")


def _offload(store: TieredStore, key: str, to: str | int) -> tuple[bool, str]:
    if store.is_pinned(key):
        return False, "pinned"
    try:
        moved = store.offload(key, to=to)
    except UsageError:  # pinned in the meantime
        return False, "pinned"
    if moved:
        return True, "moved"
    return False, "missing" if store.tier_of(key) is None else "refused"


def _hint(ctx: ApiContext, key: str, body: HintBody) -> tuple[bool, str]:
    store = ctx.store
    if store.tier_of(key) is None:
        return False, "missing"
    ctx.policy.hint(key, body.returns_in_s)
    job = f"prefetch {key}"
    ctx.later.cancel(job)
    prefetch_in = None
    if body.returns_in_s is not None:
        if body.offload and not store.is_pinned(key):
            _offload(store, key, -1)
        if body.prefetch_ahead_s is not None:
            prefetch_in = max(0.0, body.returns_in_s - body.prefetch_ahead_s)
            ctx.later.call(prefetch_in, job, lambda: store.prefetch([key]))
    ctx.hub.publish("hinted", {"key": key, "tier": store.tier_of(key), "returns_in_s": body.returns_in_s,
                               "prefetch_in_s": prefetch_in})
    return True, "hinted"


class _NotFound(KvtoolError):
    def __init__(self, key: str) -> None:
        super().__init__(f"no entry {key[:80]!r}")


class _NotStored(KvtoolError):
    def __init__(self, key: str) -> None:
        super().__init__(f"{key[:80]!r} was not stored: no tier admits it and has room")


# --- errors and schema -----------------------------------------------------------------------

def _error(code: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(code, message), status_code=ERROR_CODES[code], media_type="application/json",
                    headers=headers)


def _add_error_handlers(api: FastAPI) -> None:
    @api.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg', 'invalid')}"
            for e in exc.errors()[:5]
        )
        return _error("invalid_request", problems or "invalid request")

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        return _error(code, str(exc.detail), getattr(exc, "headers", None))

    @api.exception_handler(KvtoolError)
    async def kvtool_error(request: Request, exc: KvtoolError) -> Response:
        if isinstance(exc, _NotFound):
            return _error("not_found", str(exc))
        if isinstance(exc, _NotStored):
            return _error("not_stored", str(exc))
        if isinstance(exc, (StoreClosedError, UnavailableError)):
            return _error("unavailable", str(exc))
        if isinstance(exc, UsageError):
            return _error("invalid_request", str(exc))
        log.error("%s %s: %s", request.method, request.url.path, exc)
        return _error("internal", str(exc))

    @api.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path)
        return _error("internal", "internal error; the server log has the details")


def _openapi_with_security(api: FastAPI) -> dict:
    """FastAPI's schema, plus the bearer-token requirement of every path but the open ones."""
    if api.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=api.title, version=api.version, summary=api.summary, routes=api.routes)
        schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, operations in schema["paths"].items():
            if path not in OPEN_PATHS:
                for operation in operations.values():
                    operation["security"] = [{"bearer": []}]
        api.openapi_schema = schema
    return api.openapi_schema
