"""``Store``: what every store offers, a plain store being a one-tier stack.

``kvtool.store.records.RecordStore`` holds the single-entry calls, their checks
and the backend hooks; this class adds the calls built on them: batches (loops
by default, for backends to speed up), prefixes (one entry per chunk of
tokens, ``kvtool.store.keys``) and the tier operations.

Every store speaks tiers: a plain store is a one-tier stack, so ``tiers``,
``tier_of``, ``pin``, ``offload``, ``prefetch``, ``evict``, ``touch`` and
``subscribe`` mean on it what they mean on a ``TieredStore`` (whose
docstring describes them), and no caller asks which kind of store it holds.
A plain store's backend still chooses what leaves it when it is full (its own
least recently used order). A pin stops ``evict`` and ``offload``; the memory
store also never evicts a pinned entry, while a shared one (file, Redis) evicts
across every process's entries, as a shared tier of a stack does.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Iterable, Mapping, Sequence

from kvtool.errors import UsageError
from kvtool.store.entry import check_key
from kvtool.store.events import Subscriber
from kvtool.store.keys import PrefixHit, PrefixKeyer
from kvtool.store.records import ReadOnlyStoreError, RecordStore, StagedWrite, StoreClosedError, Value, log

__all__ = ["ReadOnlyStoreError", "StagedWrite", "Store", "StoreClosedError", "Value", "log"]


class Store(RecordStore):
    """A key -> bytes store with a capacity, integrity checks, metrics, batches, prefixes and tiers."""

    @classmethod
    def from_url(cls, url: str) -> "Store":
        raise UsageError(f"{cls.__name__} cannot be opened from a URL")

    @classmethod
    def open_existing(cls, url: str) -> "Store":
        """The store ``url`` names, opened only if it exists, creating nothing (``MissingStoreError``
        otherwise); a backend that creates nothing when it opens is opened as ``from_url`` does."""
        return cls.from_url(url)

    # --- batches: loops by default, for backends to speed up ----------------

    def put_many(self, items: Mapping[str, Value] | Iterable[tuple[str, Value]]) -> list[bool]:
        pairs = items.items() if isinstance(items, Mapping) else items
        return [self.put(key, value) for key, value in pairs]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(key) for key in keys]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.contains(key) for key in keys]

    # --- prefixes: one entry per chunk of tokens (kvtool.store.keys) ----------

    def put_prefix(
        self, keyer: PrefixKeyer, tokens: Sequence[int], chunks: Sequence[Value], meta: Mapping[str, Any] | None = None
    ) -> int:
        """Store ``chunks[i]`` (the cache of chunk ``i`` of ``tokens``); return how many were stored.

        ``chunks`` may cover only the first chunks of ``tokens``. Each entry's
        metadata gets ``tokens`` (its chunk's length) and ``prefix_tokens`` (where
        the chunk ends). Storing stops at the first chunk the store refuses, since
        later chunks could not be reached without it.
        """
        keys = keyer.keys(tokens)
        if len(chunks) > len(keys):
            raise UsageError(f"{len(chunks)} chunks given for {len(keys)} chunks of tokens")
        end = 0
        for stored, (key, chunk, length) in enumerate(zip(keys, chunks, keyer.chunk_lengths(len(tokens)))):
            end += length
            if not self.put(key, chunk, {**(meta or {}), "tokens": length, "prefix_tokens": end}):
                return stored
        return len(chunks)

    def get_prefix(self, keyer: PrefixKeyer, tokens: Sequence[int]) -> PrefixHit:
        """The longest cached prefix of ``tokens``: the values of the run of cached chunks from its start."""
        keys = keyer.keys(tokens)
        present = self.contains_many(keys)
        run = present.index(False) if False in present else len(keys)
        values: list[bytes] = []
        for value in self.get_many(keys[:run]):
            if value is None:  # lost between the lookup and the read
                break
            values.append(value)
        covered = sum(keyer.chunk_lengths(len(tokens))[:len(values)])
        return PrefixHit(values, covered, keys[:len(values)])

    # --- tiers: a plain store is its own only tier (TieredStore overrides these) --

    @property
    def tiers(self) -> Sequence[Store]:
        """The stores this one is stacked from, fastest first: ``[self]`` for a plain store."""
        return [self]

    @property
    def tier_names(self) -> list[str]:
        return [self.name]

    def tier_of(self, key: str) -> str | None:
        """The name of the tier holding ``key``, or None."""
        return self.name if self.contains(key) else None

    def offload(self, key: str, to: str | int = -1) -> bool:
        """Move ``key`` to the tier named or numbered ``to``; a plain store's one tier already holds it."""
        self._tier_index(to)
        if not self.contains(key):
            return False
        if self.is_pinned(key):
            raise UsageError(f"{key!r} is pinned; unpin it before offloading it")
        return True

    def prefetch(self, keys: Sequence[str]) -> list[Future[bool]]:
        """Bring ``keys`` to the top tier; each future gives True if its key is there (here: at once)."""
        futures: list[Future[bool]] = []
        for present in self.contains_many(list(keys)):
            future: Future[bool] = Future()
            future.set_result(present)
            futures.append(future)
        return futures

    def pin(self, key: str) -> bool:
        """Keep ``key`` where it is until ``unpin`` (``evict`` and ``offload`` refuse it); False if it is not stored."""
        found = self.contains(key)
        if found:
            with self._pin_lock:
                self._pinned.add(key)
        return found

    def unpin(self, key: str) -> bool:
        """True if ``key`` was pinned."""
        check_key(key)
        self._check_open()
        with self._pin_lock:
            pinned = key in self._pinned
            self._pinned.discard(key)
        return pinned

    def is_pinned(self, key: str) -> bool:
        with self._pin_lock:
            return key in self._pinned

    def evict(self, key: str) -> bool:
        """Remove ``key`` from every tier; a pinned key must be unpinned first."""
        check_key(key)
        self._check_writable()
        if self.is_pinned(key):
            raise UsageError(f"{key!r} is pinned; unpin it before evicting it")
        with self.events.delivering():
            removed = self._delete(key)
            if removed:
                self.metrics.count("deletes")
                self._tier_event("evicted", key, "evicted by caller")
        return removed

    def touch(self, key: str) -> bool:
        """Mark ``key`` as just used without reading it; False if it is not stored."""
        return self.contains(key)

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(event)`` for every ``StoreEvent``; returns a function that unsubscribes it."""
        return self.events.subscribe(callback)

    def flush(self) -> None:
        """Wait until every entry put so far is in a persistent tier where one is due (none in a plain store)."""
        self._check_open()

    def _tier_index(self, tier: str | int) -> int:
        names = self.tier_names
        if isinstance(tier, int) and not isinstance(tier, bool) and -len(names) <= tier < len(names):
            return tier % len(names)
        if isinstance(tier, str) and tier in names:
            return names.index(tier)
        raise UsageError(f"no tier {tier!r}; tiers: {', '.join(names)} (or 0..{len(names) - 1})")
