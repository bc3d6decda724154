"""A cache into a store entry, and a store entry into a destination: the one way every integration does either.

``put_cache`` codes a cache as a .kvz straight into the store record that keeps
it (no copy of the value between the writer and the store) and puts it.
``open_entry`` fetches an entry once (the fetch names the tier that held it;
the store parses the record but leaves the value's bytes to the .kvz reader,
which checks every chunk it reads, so each byte is hashed once) and checks it
holds what the caller's destination holds (``Expected``); ``Opened.restore``
then decodes all of it, or some layers, straight into a destination
(``kvtool.destinations``). ``restore_into`` does both.

Every failure is a ``Restored`` with its cause (``Miss``), never an exception
and never wrong bytes: an entry that is absent or out of reach is a miss; one
whose bytes fail a check is dropped from the store (``Store.drop_damaged``) and
a miss; one that holds another model's or layout's cache is a miss and stays;
one that names a dictionary or codec this process lacks is a miss and stays.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from kvtool.cache import KVCache
from kvtool.destinations import Destination
from kvtool.dtypes import DTYPES
from kvtool.errors import KvtoolError, UnknownIdError, UsageError
from kvtool.kvz import KvzError, KvzReader, KvzTooLargeError, write_cache
from kvtool.kvz.format import MAX_CHUNK_TOKENS
from kvtool.recipe import Recipe
from kvtool.store import MissCause, Store
from kvtool.store.entry import wrap_written

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("kvtool.entries")


class Miss(str, enum.Enum):
    """Why an entry was not restored."""

    MISSING = "missing"  # the store does not hold it
    DAMAGED = "damaged"  # its record or its .kvz failed a check: dropped from the store
    UNREACHABLE = "unreachable"  # the store could not be asked
    MISMATCH = "mismatch"  # it holds another cache than the destination (model, layout, dtype, size)
    UNDECODABLE = "undecodable"  # it names a dictionary or codec this process cannot load


_OF_STORE = {MissCause.MISSING: Miss.MISSING, MissCause.DAMAGED: Miss.DAMAGED, MissCause.UNREACHABLE: Miss.UNREACHABLE}


@dataclass(frozen=True)
class Expected:
    """What a destination holds, so that an entry holding anything else is a miss: ``layers`` layers (ids
    ``0..layers - 1``), every key and value tensor ``shape`` ``[heads, tokens, dim]``, of ``dtype`` (kvtool's name;
    None: any)."""

    layers: int
    shape: tuple[int, int, int]
    dtype: str | None = None

    def problem(self, reader: KvzReader) -> str | None:
        """Why the opened entry does not fit, or None."""
        if self.dtype is not None and reader.dtype.name != self.dtype:
            return f"it holds {reader.dtype.name} tensors, not {self.dtype}"
        if reader.layer_ids != list(range(self.layers)):
            return f"it holds layers {reader.layer_ids[:4]}{'...' if len(reader.layer_ids) > 4 else ''}, not 0..{self.layers - 1}"
        shapes = {shape for _, _, shape in reader.tensors}
        if shapes - {self.shape}:
            return f"its tensors are {sorted(shapes)}, not {list(self.shape)}"
        return None

    @property
    def max_bytes(self) -> int | None:
        """The most a read of the entry may decode to, where the dtype is known."""
        if self.dtype is None:
            return None
        heads, tokens, dim = self.shape
        return 2 * self.layers * heads * tokens * dim * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Restored:
    """What one restore did: the tier it came from and its sizes and times, or why it did not (``miss``)."""

    key: str
    miss: Miss | None
    detail: str = ""
    tier: str | None = None
    stored_bytes: int = 0  # the entry's record
    raw_bytes: int = 0  # what was written into the destination
    fetch_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.miss is None


class Opened:
    """A fetched entry that holds what the destination holds; ``restore`` it (whole, or some layers at a time), then
    ``close``. One thread at a time."""

    def __init__(self, store: Store, key: str, reader: KvzReader, tier: str | None, stored_bytes: int,
                 fetch_seconds: float):
        self.store, self.key, self.reader = store, key, reader
        self.tier, self.stored_bytes, self.fetch_seconds = tier, stored_bytes, fetch_seconds

    def restore(self, destination: Destination, layers: Sequence[int] | None = None, tokens: slice | None = None,
                threads: int | None = 1) -> Restored:
        """Decode ``layers`` (all by default) and a token range straight into ``destination``."""
        start = time.perf_counter()
        try:
            self.reader.read_into(destination, layers, tokens, threads)
        except KvtoolError as exc:
            return self.fail(exc)
        h = self.reader.header
        start_token, stop_token = (0, h.num_tokens) if tokens is None else tokens.indices(h.num_tokens)[:2]
        count = 2 * (len(self.reader.layer_ids) if layers is None else len(layers))
        raw = count * h.heads * (stop_token - start_token) * h.dim * h.dtype.itemsize
        return Restored(self.key, None, "", self.tier, self.stored_bytes, raw, self.fetch_seconds,
                        time.perf_counter() - start)

    def fail(self, exc: KvtoolError) -> Restored:
        """The miss ``exc`` (raised while restoring this entry) means; a damaged entry is dropped from the store."""
        return _failed(self.store, self.key, exc, self.tier, self.stored_bytes, self.fetch_seconds)

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_entry(store: Store, key: str, expected: Expected) -> Opened | Restored:
    """Fetch ``key`` once and open its .kvz (header and index checked): an ``Opened`` that holds what ``expected``
    says, or the ``Restored`` miss saying why not."""
    start = time.perf_counter()
    try:
        fetched = store.fetch(key, check_value=False)
    except KvtoolError as exc:  # a closed store or a bad key: the caller's to fix, still no wrong bytes
        return Restored(key, Miss.UNREACHABLE, str(exc))
    seconds = time.perf_counter() - start
    entry = fetched.entry
    if entry is None:
        cause = _OF_STORE[MissCause(fetched.cause)] if fetched.cause is not None else Miss.MISSING
        return Restored(key, cause, fetched.detail, fetch_seconds=seconds)
    try:
        reader = KvzReader.from_bytes(entry.value, **_limits(expected))
    except KvtoolError as exc:
        return _failed(store, key, exc, fetched.tier, entry.size, seconds)
    problem = expected.problem(reader)
    if problem is not None:
        reader.close()
        return Restored(key, Miss.MISMATCH, problem, fetched.tier, entry.size, fetch_seconds=seconds)
    return Opened(store, key, reader, fetched.tier, entry.size, seconds)


def restore_into(store: Store, key: str, expected: Expected, destination: Destination,
                 layers: Sequence[int] | None = None, tokens: slice | None = None, threads: int | None = 1) -> Restored:
    """Fetch ``key`` once and decode it (all of it, or some layers and tokens) straight into ``destination``, its chunks
    shared by ``threads`` workers."""
    opened = open_entry(store, key, expected)
    if isinstance(opened, Restored):
        return opened
    with opened:
        return opened.restore(destination, layers, tokens, threads)


@dataclass(frozen=True)
class PutResult:
    """What one put did: the entry's size, or why it was not stored (``cause``: ``"encode"``, the recipe cannot code
    the cache; ``"refused"``, the store did not take it)."""

    key: str
    stored: bool
    stored_bytes: int = 0  # the record's size (0 when not stored)
    raw_bytes: int = 0
    encode_seconds: float = 0.0
    put_seconds: float = 0.0
    cause: str = ""
    detail: str = ""


def put_cache(store: Store, key: str, cache: KVCache, recipe: Recipe | str, *, chunk_tokens: int | None = None,
              meta: Mapping[str, Any] | None = None, threads: int | None = 1) -> PutResult:
    """Code ``cache`` with ``recipe`` (chunks of ``chunk_tokens``: by default the whole cache in one chunk per tensor,
    what a restore of it all reads fastest) and store it under ``key``, with ``meta`` beside the token count and raw
    size. A refusal by the store or a cache the recipe cannot code is a ``PutResult`` that says so."""
    chunk = max(1, min(cache.num_tokens, MAX_CHUNK_TOKENS)) if chunk_tokens is None else chunk_tokens
    start = time.perf_counter()
    try:
        entry = wrap_written(key, {**(meta or {}), "tokens": cache.num_tokens, "raw_bytes": cache.nbytes},
                             lambda out: write_cache(out, cache, recipe, chunk_tokens=chunk, threads=threads))
    except UsageError as exc:
        return PutResult(key, False, raw_bytes=cache.nbytes, cause="encode", detail=str(exc))
    encoded = time.perf_counter()
    stored = store.put_entry(entry)
    return PutResult(key, stored, entry.size if stored else 0, cache.nbytes, encoded - start,
                     time.perf_counter() - encoded, "" if stored else "refused",
                     "" if stored else f"{store.describe()} refused it")


def _limits(expected: Expected) -> dict[str, int]:
    most = expected.max_bytes
    return {} if most is None else {"max_size": most}


def _failed(store: Store, key: str, exc: KvtoolError, tier: str | None, stored_bytes: int, seconds: float) -> Restored:
    """The miss ``exc`` means for the entry under ``key``: a damaged one is dropped from the store."""
    if isinstance(exc, KvzTooLargeError):
        miss = Miss.MISMATCH  # more than the destination holds
    elif isinstance(exc, KvzError):
        miss = Miss.DAMAGED
        store.drop_damaged(key, str(exc))
    elif isinstance(exc, UsageError) and not isinstance(exc, UnknownIdError):
        miss = Miss.MISMATCH  # layers or rows the destination does not have
    else:
        miss = Miss.UNDECODABLE  # a codec or dictionary this process lacks: the entry stays for those that have it
    return Restored(key, miss, str(exc), tier, stored_bytes, fetch_seconds=seconds)
