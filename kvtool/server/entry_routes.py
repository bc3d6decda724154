"""The endpoints that read and write entries: stats, the entry list, one entry, its value.

Reads are plain functions (FastAPI runs them in its thread pool, since store
calls block); ``PUT /v1/entry/value`` is async so that it can read the body,
and hands the store calls to the thread pool itself.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from kvtool.errors import UsageError
from kvtool.server.context import ApiContext
from kvtool.server.http_errors import NotFound, NotStored
from kvtool.server.schemas import EntryDetail, EntryList, EntryRow, ErrorBody, Key, Stored
from kvtool.store.entry import check_key


def add_entry_routes(router: APIRouter, ctx: ApiContext) -> None:
    """Add the entry endpoints to ``router`` (the API's ``/v1`` router, whose routes carry full paths)."""
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
            raise NotFound(key)
        assert isinstance(row, EntryDetail)  # with_meta gives the detail
        return row

    @router.get("/entry/value", response_class=Response, tags=["store"],
                responses={200: {"content": {"application/octet-stream": {}}}, 404: {"model": ErrorBody}})
    def get_value(key: Annotated[Key, Query()]) -> Response:
        """The entry's bytes, verified; a hit below the top is promoted as any read is."""
        found = store.get_entry(key)
        if found is None:
            raise NotFound(key)
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
            raise NotStored(key)
        return Stored(key=key, tier=await run_in_threadpool(store.tier_of, key))


def _row(ctx: ApiContext, key: str, with_meta: bool = False) -> EntryRow | None:
    info = ctx.store.info(key)
    if info is None:
        return None
    fields: dict[str, Any] = dict(key=key, tier=ctx.store.tier_of(key), bytes=info.size, tokens=info.tokens,
                  pinned=ctx.store.is_pinned(key), due_in_s=ctx.policy.due_in(key))
    return EntryDetail(**fields, meta=info.meta) if with_meta else EntryRow(**fields)
