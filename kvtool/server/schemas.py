"""The API's request and response bodies, as pydantic models (they are its OpenAPI schema too)."""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, Field, StringConstraints

from kvtool.server.guards import ERROR_CODES
from kvtool.server.lookup import PrefixQuery

MAX_KEYS = 4096  # per request

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
