"""``TieredStore``: ordinary stores stacked fastest first, with a policy moving entries between them.

New entries land in the highest tier the policy admits them to. A tier that
needs room demotes its coldest entries (by the policy's order) to the next tier
that admits them and has room, instead of dropping them; the bottom tier
evicts. A hit in a lower tier is promoted to the top (``promote=True``).
Pinned entries are never demoted or evicted by this store.

Write-behind (``write_behind=N``, off by default; the vLLM connector turns it
on): an entry put into a tier that dies with the process (memory) is also
copied, in the background, to the first persistent tier below it that the
policy admits (file, Redis), and stays where it was put. The queue holds at most
``write_behind`` entries; when it is full, ``put`` copies the entry itself before
returning. So at any moment at most ``write_behind`` entries (plus the one being
written) exist only in memory, and a killed process loses at most those; other
processes see an entry once its copy is written. ``flush()`` waits for the
queue. Demoting an entry that already has its copy is a delete. On ``close``
(``save_on_close``) the queue is drained and what is left in volatile tiers moves
down, so the next process finds it. An entry that no persistent tier takes then
(it is full of entries it will not give up, too small, or failing) cannot be
kept past the process: it is reported as lost, never dropped silently (one
warning with the count, an ``evicted`` event per entry, and its key in
``lost_on_close``).

Each entry lives in one tier, apart from its write-behind copy and ``shared``
tiers (file, Redis): other processes rely on their entries, so promoting an
entry out of one leaves its copy there. A shared tier evicts by itself, across
every process's entries (its own least recently used order), so this store
only demotes out of a shared tier when a lower tier can take the entry; the
entries it knows that a tier evicts by itself are reported as ``evicted``
events. Entries of non-shared tiers are indexed when the ``TieredStore`` opens;
shared tiers are asked on demand.

Hot/cold scheduling: ``offload(key, to)``, ``prefetch(keys)`` (a background
thread pool; returns futures), ``pin``/``unpin``, ``evict``, ``touch``,
``tier_of``. ``subscribe(callback)`` reports every move as a ``StoreEvent``;
callbacks run in the thread that caused the event, after the store's lock is
released, so a callback may call the store.

Thread-safe, and no tier I/O happens under a lock: ``Placements``
(``kvtool.store.placements``) keeps the index, pins, claims and reservations
under its own lock, and events are delivered after it is released. A write or move claims its key and reserves room in the tier it
goes to (choosing and claiming the entries that must leave first) under the
lock, copies outside it, and commits the new placement under it again; the
source copy is deleted after the commit. So a slow tier (a disk, Redis) being
written or read never blocks hits in the memory tier, and a reader racing a
move finds the entry in its old tier or its new one. Operations on one key are
serialised by its claim (a second put of a key waits for the first); a hit on
a key that is being moved is served where it is, without waiting.

Under a ``TieredStore`` the non-shared tiers (memory) keep no eviction order of
their own: the policy decides what leaves, and such a tier refuses a write that
does not fit instead of evicting. Shared tiers (file, Redis) still evict by
themselves, since other processes' entries compete for their room.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

from kvtool.errors import UsageError
from kvtool.store.base import Store, log
from kvtool.store.entry import Entry, EntryInfo, check_key
from kvtool.store.moves import TierMoves, delivering_events, unique_names
from kvtool.store.placements import Placements
from kvtool.store.policy import LRUPolicy, Policy, TierProfile
from kvtool.store.results import Fetched, MissCause
from kvtool.store.writebehind import WriteBehind

DEFAULT_WRITE_BEHIND = 64  # entries that may wait in memory for their persistent copy (the vLLM connector's)

_READ_ATTEMPTS = 3  # a concurrent move can hide an entry from one read, not from three

class TieredStore(TierMoves):
    scheme = "tiered"

    def __init__(
        self,
        tiers: Sequence[Store],
        policy: Policy | None = None,
        promote: bool = True,
        *,
        save_on_close: bool = True,
        prefetch_workers: int = 4,
        write_behind: int = 0,
        name: str | None = None,
    ) -> None:
        if not tiers:
            raise UsageError("a tiered store needs at least one tier")
        if write_behind < 0:
            raise UsageError(f"write_behind is a number of entries, not {write_behind}")
        self._tiers = list(tiers)
        super().__init__(capacity=None, name=name)
        self._tier_names = unique_names([t.name for t in self._tiers])
        self.policy = policy or LRUPolicy()
        self.promote = promote
        self.save_on_close = save_on_close
        self.persistent = any(t.persistent for t in self._tiers)
        self.shared = any(t.shared for t in self._tiers)
        self.profiles = [TierProfile(t.typical_latency_s, t.typical_bandwidth) for t in self._tiers]
        self._prefetch_workers = prefetch_workers
        self._executor: ThreadPoolExecutor | None = None
        self._placements = Placements(len(self._tiers))
        self.lost_on_close: list[str] = []  # keys only a volatile tier held that no persistent tier took on close
        self._write_behind = WriteBehind(write_behind, self._persist, self.name) if write_behind else None
        for index, tier in enumerate(self._tiers):
            tier.on_evicted = functools.partial(self._tier_evicted, index)
            if not tier.shared:
                tier.evicts_by_itself = False  # the policy chooses what leaves it
        self._index_tiers()

    def describe(self) -> str:
        return ",".join(t.describe() for t in self._tiers)

    @property
    def read_only(self) -> bool:
        return self._read_only

    @read_only.setter
    def read_only(self, value: bool) -> None:
        """Read-only applies to every tier too: a damaged entry below stays where it is."""
        self._read_only = value
        for tier in getattr(self, "_tiers", ()):
            tier.read_only = value

    @property
    def used_bytes(self) -> int:
        return sum(t.used_bytes or 0 for t in self._tiers)

    # --- the Store interface --------------------------------------------------

    @delivering_events
    def fetch(self, key: str, *, check_value: bool = True) -> Fetched:
        """The entry from whichever tier holds it (promoted to the top if ``promote``), or why none could; a hit names
        that tier."""
        check_key(key)
        self._check_open()
        start = time.perf_counter()
        fetched = self._fetch(key, to_top=self.promote and not self.read_only, reason="hit", check_value=check_value)
        if fetched.entry is None:
            self.metrics.miss(time.perf_counter() - start)
        else:
            self.metrics.hit(time.perf_counter() - start, fetched.entry.size)
        return fetched

    def get_entry(self, key: str) -> Entry | None:
        return self.fetch(key).entry

    def stats(self) -> dict[str, Any]:
        data = super().stats()
        indexed = self._placements.count_by_tier()
        data.update(
            policy=self.policy.describe(),
            promote=self.promote,
            pinned=self._placements.pinned_count(),
            events=self.events.counts(),
        )
        if self._write_behind is not None:
            data["write_behind"] = self._write_behind.stats()
        data["tiers"] = [
            {"tier": name, **tier.stats(), "indexed_entries": indexed[i], "profile": profile.to_dict()}
            for i, (name, tier, profile) in enumerate(zip(self.tier_names, self._tiers, self.profiles))
        ]
        return data

    def flush(self) -> None:
        """Wait until every entry put so far has its copy in a persistent tier (or failed to get one)."""
        self._check_open()
        if self._write_behind is not None:
            self._write_behind.flush()

    def close(self) -> None:
        if self._closed:
            return
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        if self._write_behind is not None:
            self._write_behind.close(drain=self.save_on_close and not self.read_only)
        if self.save_on_close and not self.read_only:
            with self.events.delivering():
                self.lost_on_close = self._save_volatile()
        super().close()

    # --- hot/cold scheduling --------------------------------------------------

    @delivering_events
    def tier_of(self, key: str) -> str | None:
        """The name of the tier holding ``key``, or None."""
        self._check_key_open(key)
        placement = self._locate(key)
        return None if placement is None else self.tier_names[placement.tier]

    @delivering_events
    def offload(self, key: str, to: str | int = -1) -> bool:
        """Move ``key`` to the tier named or numbered ``to`` (default: the bottom); False if absent or refused."""
        self._check_key_open(key)
        target = self._tier_index(to)
        with self._placements.claim(key):
            if self._locate(key) is None:
                return False
            if self.is_pinned(key):
                raise UsageError(f"{key!r} is pinned; unpin it before offloading it")
            return self._move(key, target, "offloaded by caller", report_no_room=True)

    def prefetch(self, keys: Sequence[str]) -> list[Future[bool]]:
        """Bring ``keys`` to the top tier in the background; each future gives True if its key is there."""
        self._check_open()
        for key in keys:
            check_key(key)
        with self._placements.lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._prefetch_workers, thread_name_prefix="kvtool-prefetch")
            executor = self._executor
        return [executor.submit(self._prefetch_one, key) for key in keys]

    @delivering_events
    def pin(self, key: str) -> bool:
        """Keep ``key`` in its tier (or higher) until ``unpin``; False if it is not stored."""
        self._check_key_open(key)
        with self._placements.claim(key):  # waits for a move of it to finish
            placement = self._locate(key)
            if placement is None or not self._placements.pin(placement):
                return False
            tier = self._tiers[placement.tier]
            if tier.shared:  # a shared tier makes room by itself: it must know the pin too
                tier.pin(key)
            return True

    def unpin(self, key: str) -> bool:
        """True if ``key`` was pinned."""
        self._check_key_open(key)
        for index in self._shared_tiers():
            self._tiers[index].unpin(key)
        return self._placements.unpin(key)

    def is_pinned(self, key: str) -> bool:
        return self._placements.is_pinned(key)

    @delivering_events
    def evict(self, key: str) -> bool:
        """Remove ``key`` from every tier; a pinned key must be unpinned first."""
        self._check_key_open(key)
        with self._placements.claim(key):
            if self.is_pinned(key):
                raise UsageError(f"{key!r} is pinned; unpin it before evicting it")
            return self._remove_everywhere(key, "evicted by caller")

    @delivering_events
    def touch(self, key: str) -> bool:
        """Mark ``key`` as just used without reading it; False if it is not stored."""
        self._check_key_open(key)
        placement = self._locate(key)
        if placement is not None:
            with self._placements.lock:
                placement.last_access = time.monotonic()
        return placement is not None

    # --- backend hooks, in terms of the tiers ---------------------------------

    def _read(self, key: str) -> bytes | None:
        placement = self._locate(key)
        return None if placement is None else self._tiers[placement.tier].read_record(key)

    @delivering_events
    def _write(self, info: EntryInfo, record: bytes) -> bool:
        with self._placements.claim(info.key):
            stored = self._place(info, record)
            placement = self._placements.get(info.key) if stored else None
            persist = placement is not None and self._persist_target(placement) is not None
        if self._write_behind is not None and persist:  # after the claim: a full queue makes this thread write
            self._write_behind.submit(info.key)
        return stored

    @delivering_events
    def _delete(self, key: str) -> bool:
        with self._placements.claim(key):
            return self._remove_everywhere(key, "deleted")

    def _contains(self, key: str) -> bool:
        placement = self._placements.get(key)
        if placement is not None and not self._tiers[placement.tier].shared:
            return True
        return any(self._tiers[i].contains(key) for i in self._shared_tiers())

    def _keys(self) -> list[str]:
        keys = dict.fromkeys(self._placements.keys_in([i for i, t in enumerate(self._tiers) if not t.shared]))
        for i in self._shared_tiers():
            keys.update(dict.fromkeys(self._tiers[i].keys()))
        return list(keys)

    def _info(self, key: str) -> EntryInfo | None:
        placement = self._placements.get(key)
        if placement is not None and not self._tiers[placement.tier].shared:
            return self._tiers[placement.tier].info(key)
        for index in self._shared_tiers():  # asked without indexing: lookups must not grow the index
            info = self._tiers[index].info(key)
            if info is not None:
                return info
        return None

    def _close(self) -> None:
        for tier in self._tiers:
            tier.close()

    # --- reads ----------------------------------------------------------------

    def _fetch(self, key: str, to_top: bool, reason: str, check_value: bool = True) -> Fetched:
        """Read ``key`` from its tier (outside the lock), then move it to the top if asked; or say why not.

        A miss in every tier asked reports the gravest cause a tier gave: damaged, then unreachable, then missing.
        """
        causes: list[Fetched] = []
        for _ in range(_READ_ATTEMPTS):
            seen = self._placements.get(key)
            where = [seen.tier] if seen is not None else self._shared_tiers()
            for index in where:
                start = time.perf_counter()
                fetched = self._tiers[index].fetch(key, check_value=check_value)
                entry = fetched.entry
                if entry is None:
                    causes.append(fetched)
                    continue
                self.profiles[index].observe(entry.size, time.perf_counter() - start)
                with self._placements.lock:
                    current = self._placements.get(key)
                    if current is None and seen is None:
                        current = self._placements.register(entry, index)
                    unchanged = current is not None and (seen is None or current is seen) and current.tier == index
                    if current is not None and unchanged:
                        current.hits += 1
                        current.last_access = time.monotonic()
                    # a key being moved is not promoted: this read does not wait
                    promote = unchanged and to_top and index > 0 and self._placements.try_claim(key)
                if promote:
                    try:
                        self._move(key, 0, reason, entry)
                    finally:
                        self._placements.release([key])
                return Fetched(key, entry, None, tier=self.tier_names[index])
            if seen is None or self.read_only:  # read-only: a damaged entry stays, indexed where it is
                break
            with self._placements.lock:
                if self._placements.get(key) is seen and seen.tier == where[0]:
                    self._forget(seen, f"gone from {self.tier_names[seen.tier]} (expired, evicted, damaged or unreachable)")
        return _gravest(key, causes)

    @delivering_events
    def _prefetch_one(self, key: str) -> bool:
        placement = self._placements.get(key)
        if placement is not None and placement.tier == 0:
            return True
        try:
            fetched = self._fetch(key, to_top=True, reason="prefetched")
            placement = self._placements.get(key)
            return fetched.entry is not None and placement is not None and placement.tier == 0
        except Exception:  # noqa: BLE001 - a prefetch runs in a pool thread: logged, reported as False
            log.exception("%s: prefetch of %r failed", self.name, key)
            return False

_GRAVITY = {MissCause.DAMAGED: 0, MissCause.UNREACHABLE: 1, MissCause.MISSING: 2}


def _gravest(key: str, causes: list[Fetched]) -> Fetched:
    """The miss to report from the tiers' answers (a missing entry when no tier was asked)."""
    ranked = sorted((c for c in causes if c.cause is not None), key=lambda c: _GRAVITY[MissCause(c.cause)])
    return ranked[0] if ranked else Fetched(key, None, MissCause.MISSING, "no tier holds it")
