"""The HTTP API over a ``TieredStore``: the hot/cold scheduling calls, lookups, events and metrics.

``create_app`` returns an ASGI application; ``kvtool.server.run`` serves it.
Entries are named by keys in query strings and JSON bodies, never by paths, so
no request can reach a file outside the store. The endpoints live in
``entry_routes`` (reading and writing entries) and ``scheduling_routes``
(lookup, pin, prefetch, offload, evict, hint, events); their bodies in
``schemas``; failures become answers in ``http_errors``. This module joins
them behind the guards (rate, token, body size) and the metrics.

Store calls block (a file tier, Redis), so the endpoints that make them are
plain functions, which FastAPI runs in its thread pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import kvtool
from kvtool.server.context import ApiContext, Limits
from kvtool.server.entry_routes import add_entry_routes
from kvtool.server.events import EventHub
from kvtool.server.guards import App, AuthGuard, BodyGuard, RateGuard, Receive, Scope, Send
from kvtool.server.http_errors import add_error_handlers
from kvtool.server.later import Later
from kvtool.server.lookup import BlockHasher
from kvtool.server.metrics import ApiMetrics
from kvtool.server.scheduling_routes import add_scheduling_routes
from kvtool.server.schemas import ErrorBody, Health
from kvtool.store import TieredStore
from kvtool.store.policy import HintedPolicy

OPEN_PATHS = frozenset({"/v1/health", "/metrics", "/openapi.json"})


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
    add_error_handlers(api)
    api.include_router(_open_routes())
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

    asgi: App
    fastapi: FastAPI
    context: ApiContext
    close: Callable[[], None]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.asgi(scope, receive, send)


def _open_routes() -> APIRouter:
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
    # One router, so that each route's own path is the full path (the metrics label requests by it).
    router = APIRouter(prefix="/v1", responses=errors)
    add_entry_routes(router, ctx)
    add_scheduling_routes(router, ctx, limits)
    return router


def _openapi_with_security(api: FastAPI) -> dict[str, Any]:
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
