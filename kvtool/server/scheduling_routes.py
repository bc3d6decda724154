"""The scheduling endpoints: lookup, pin, unpin, evict, touch, offload, prefetch, hint, and the event stream.

Each call that acts on entries takes ``keys`` or a ``prefix`` (a prompt,
resolved to the keys of its stored chunks exactly as ``/v1/lookup`` resolves
it) and answers per key with a ``KeyResult``.
"""

from __future__ import annotations

from concurrent.futures import wait as wait_for_futures
from typing import Annotated, Callable

from fastapi import APIRouter, Header
from fastapi.responses import StreamingResponse

from kvtool.errors import UnavailableError, UsageError
from kvtool.server.context import ApiContext, Limits
from kvtool.server.events import TooManyListeners
from kvtool.server.lookup import LookupResult, PrefixQuery, lookup_prefix
from kvtool.server.schemas import BatchResult, HintBody, KeyResult, OffloadBody, PrefetchBody, Selection
from kvtool.store import TieredStore
from kvtool.store.entry import check_key


def add_scheduling_routes(router: APIRouter, ctx: ApiContext, limits: Limits) -> None:
    """Add the scheduling endpoints to ``router`` (the API's ``/v1`` router)."""
    store = ctx.store

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
