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
down, so the next process finds it.

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

Thread-safe, and no tier I/O happens under the store's lock: the lock guards
only the index. A write or move claims its key and reserves room in the tier it
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

import contextlib
import functools
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from threading import RLock
from typing import Any, Iterator, Sequence

from kvtool.errors import UsageError
from kvtool.store.base import Store, log
from kvtool.store.entry import CorruptEntryError, Entry, EntryInfo, check_key, unwrap
from kvtool.store.events import StoreEvent
from kvtool.store.policy import LRUPolicy, Placement, Policy, TierProfile

DEFAULT_WRITE_BEHIND = 64  # entries that may wait in memory for their persistent copy (the vLLM connector's)

_READ_ATTEMPTS = 3  # a concurrent move can hide an entry from one read, not from three


class TieredStore(Store):
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
        self._tier_names = _unique_names([t.name for t in self._tiers])
        self.policy = policy or LRUPolicy()
        self.promote = promote
        self.save_on_close = save_on_close
        self.persistent = any(t.persistent for t in self.tiers)
        self.shared = any(t.shared for t in self.tiers)
        self.profiles = [TierProfile(t.typical_latency_s, t.typical_bandwidth) for t in self.tiers]
        self._prefetch_workers = prefetch_workers
        self._executor: ThreadPoolExecutor | None = None
        self._lock = RLock()
        self._released = threading.Condition(self._lock)  # notified when a key's claim ends
        self._placed: dict[str, Placement] = {}
        self._pinned: set[str] = set()
        self._claimed: set[str] = set()  # keys a write or move is working on outside the lock
        self._reserved = [0] * len(self.tiers)  # bytes promised to writes in progress, per tier
        self._leaving = [0] * len(self.tiers)  # bytes of entries being moved out, per tier
        self._write_behind = _WriteBehind(self, write_behind) if write_behind else None
        for index, tier in enumerate(self.tiers):
            tier.on_evicted = functools.partial(self._tier_evicted, index)
            if not tier.shared:
                tier.evicts_by_itself = False  # the policy chooses what leaves it
        self._index_tiers()

    def describe(self) -> str:
        return ",".join(t.describe() for t in self.tiers)

    @property
    def tiers(self) -> list[Store]:
        return self._tiers

    @property
    def tier_names(self) -> list[str]:
        return self._tier_names

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
        return sum(t.used_bytes or 0 for t in self.tiers)

    # --- the Store interface --------------------------------------------------

    def get_entry(self, key: str) -> Entry | None:
        check_key(key)
        self._check_open()
        start = time.perf_counter()
        entry = self._fetch(key, to_top=self.promote and not self.read_only, reason="hit")
        if entry is None:
            self.metrics.miss(time.perf_counter() - start)
        else:
            self.metrics.hit(time.perf_counter() - start, entry.size)
        self._flush_events()
        return entry

    def stats(self) -> dict[str, Any]:
        data = super().stats()
        with self._lock:
            indexed = Counter(p.tier for p in self._placed.values())
            data.update(
                policy=self.policy.describe(),
                promote=self.promote,
                pinned=len(self._pinned),
                events=self.events.counts(),
            )
        if self._write_behind is not None:
            data["write_behind"] = self._write_behind.stats()
        data["tiers"] = [
            {"tier": name, **tier.stats(), "indexed_entries": indexed[i], "profile": profile.to_dict()}
            for i, (name, tier, profile) in enumerate(zip(self.tier_names, self.tiers, self.profiles))
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
            self._save_volatile()
            self._flush_events()
        super().close()

    # --- hot/cold scheduling --------------------------------------------------

    def tier_of(self, key: str) -> str | None:
        """The name of the tier holding ``key``, or None."""
        self._check_key_open(key)
        placement = self._locate(key)
        self._flush_events()
        return None if placement is None else self.tier_names[placement.tier]

    def offload(self, key: str, to: str | int = -1) -> bool:
        """Move ``key`` to the tier named or numbered ``to`` (default: the bottom); False if absent or refused."""
        self._check_key_open(key)
        target = self._tier_index(to)
        with self._claim(key):
            if self._locate(key) is None:
                return False
            if self.is_pinned(key):
                raise UsageError(f"{key!r} is pinned; unpin it before offloading it")
            moved = self._move(key, target, "offloaded by caller", report_no_room=True)
        self._flush_events()
        return moved

    def prefetch(self, keys: Sequence[str]) -> list[Future]:
        """Bring ``keys`` to the top tier in the background; each future gives True if its key is there."""
        self._check_open()
        for key in keys:
            check_key(key)
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._prefetch_workers, thread_name_prefix="kvtool-prefetch")
        return [self._executor.submit(self._prefetch_one, key) for key in keys]

    def pin(self, key: str) -> bool:
        """Keep ``key`` in its tier (or higher) until ``unpin``; False if it is not stored."""
        self._check_key_open(key)
        with self._claim(key):  # waits for a move of it to finish
            placement = self._locate(key)
            with self._lock:
                found = placement is not None and self._placed.get(key) is placement
                if found:
                    self._pinned.add(key)
        self._flush_events()
        return found

    def unpin(self, key: str) -> bool:
        """True if ``key`` was pinned."""
        self._check_key_open(key)
        with self._lock:
            pinned = key in self._pinned
            self._pinned.discard(key)
            return pinned

    def is_pinned(self, key: str) -> bool:
        with self._lock:
            return key in self._pinned

    def evict(self, key: str) -> bool:
        """Remove ``key`` from every tier; a pinned key must be unpinned first."""
        self._check_key_open(key)
        with self._claim(key):
            if self.is_pinned(key):
                raise UsageError(f"{key!r} is pinned; unpin it before evicting it")
            removed = self._remove_everywhere(key, "evicted by caller")
        self._flush_events()
        return removed

    def touch(self, key: str) -> bool:
        """Mark ``key`` as just used without reading it; False if it is not stored."""
        self._check_key_open(key)
        placement = self._locate(key)
        if placement is not None:
            with self._lock:
                placement.last_access = time.monotonic()
        self._flush_events()
        return placement is not None

    # --- backend hooks, in terms of the tiers ---------------------------------

    def _read(self, key: str) -> bytes | None:
        placement = self._locate(key)
        return None if placement is None else self.tiers[placement.tier].read_record(key)

    def _write(self, info: EntryInfo, record: bytes) -> bool:
        with self._claim(info.key):
            stored = self._place(info, record)
            with self._lock:
                placement = self._placed.get(info.key)
                behind = self._write_behind if stored and placement is not None else None
                persist = behind is not None and placement is not None and self._persist_target(placement) is not None
        if behind is not None and persist:  # after the claim ends: a full queue makes this thread write the copy
            behind.submit(info.key)
        self._flush_events()
        return stored

    def _delete(self, key: str) -> bool:
        with self._claim(key):
            removed = self._remove_everywhere(key, "deleted")
        self._flush_events()
        return removed

    def _contains(self, key: str) -> bool:
        with self._lock:
            placement = self._placed.get(key)
            if placement is not None and not self.tiers[placement.tier].shared:
                return True
        return any(self.tiers[i].contains(key) for i in self._shared_tiers())

    def _keys(self) -> list[str]:
        with self._lock:
            keys = dict.fromkeys(k for k, p in self._placed.items() if not self.tiers[p.tier].shared)
        for i in self._shared_tiers():
            keys.update(dict.fromkeys(self.tiers[i].keys()))
        return list(keys)

    def _info(self, key: str) -> EntryInfo | None:
        with self._lock:
            placement = self._placed.get(key)
            tier = None if placement is None or self.tiers[placement.tier].shared else self.tiers[placement.tier]
        if tier is not None:
            return tier.info(key)
        for index in self._shared_tiers():  # asked without indexing: lookups must not grow the index
            info = self.tiers[index].info(key)
            if info is not None:
                return info
        return None

    def _close(self) -> None:
        for tier in self.tiers:
            tier.close()

    # --- claims and room -----------------------------------------------------

    @contextlib.contextmanager
    def _claim(self, key: str) -> Iterator[None]:
        """Hold ``key`` for one write or move, waiting while another operation holds it."""
        with self._lock:
            while key in self._claimed:
                self._released.wait()
            self._claimed.add(key)
        try:
            yield
        finally:
            self._release([key])

    def _release(self, keys: Sequence[str]) -> None:
        with self._lock:
            self._claimed.difference_update(keys)
            self._released.notify_all()

    def _reserve_room(self, index: int, need: int) -> list[Placement] | None:
        """Reserve ``need`` bytes in tier ``index`` (lock held); the entries that must leave it first, or None.

        The entries returned are claimed; ``_make_room`` moves them out. A shared
        tier evicts by itself when written (other processes' entries compete
        for its room): entries this store knows there are only chosen when a
        lower tier exists, and the tier makes the rest of the room. The caller
        gives the reservation back with ``_unreserve`` once its write is done.
        """
        tier = self.tiers[index]
        if tier.capacity is not None and need > tier.capacity:
            return None
        victims: list[Placement] = []
        if tier.capacity is not None and need > 0:
            free = tier.capacity - (tier.used_bytes or 0) - self._reserved[index] + self._leaving[index]
            if free < need and not (tier.shared and index == len(self.tiers) - 1):
                candidates = [
                    p for p in self._placed.values()
                    if p.tier == index and p.key not in self._pinned and p.key not in self._claimed
                ]
                for victim in self.policy.coldest_first(candidates, self.profiles[index], time.monotonic()):
                    if free >= need:
                        break
                    victims.append(victim)
                    free += victim.size
                if free < need and not tier.shared:
                    return None
        for victim in victims:
            self._claimed.add(victim.key)
            self._leaving[index] += victim.size
        self._reserved[index] += max(need, 0)
        return victims

    def _unreserve(self, index: int, need: int) -> None:
        with self._lock:
            self._reserved[index] -= max(need, 0)

    def _make_room(self, victims: list[Placement]) -> None:
        """Move the entries ``_reserve_room`` chose out of their tier (no lock held), then release them."""
        for victim in victims:
            source = victim.tier
            try:
                self._demote(victim)
            finally:
                with self._lock:
                    self._leaving[source] -= victim.size
                self._release([victim.key])

    # --- placement (no lock held; the caller has claimed the key) -------------

    def _place(self, info: EntryInfo, record: bytes) -> bool:
        """Put a new record in the highest tier that admits it and has room."""
        with self._lock:
            old = self._placed.get(info.key)
        placement = Placement(info.key, -1, info.size, info.tokens, time.monotonic())
        for index, tier in enumerate(self.tiers):
            if not self.policy.admits(placement, self.profiles[index]):
                continue
            need = info.size - (old.size if old is not None and old.tier == index else 0)
            with self._lock:
                victims = self._reserve_room(index, need)
            if victims is None:
                continue
            try:
                self._make_room(victims)
                written = tier.put_entry(info) if isinstance(info, Entry) else tier.write_record(info.key, record)
            finally:
                self._unreserve(index, need)
            if not written:
                continue
            with self._lock:
                placement.tier = index
                self._placed[info.key] = placement
                self._event("stored", info.key, index)
            stale_tiers = {old.tier, old.copy_in} - {index, None} if old is not None else set()
            for stale in stale_tiers:
                if stale is not None:
                    self.tiers[stale].delete(info.key)  # the old value must not outlive the new one
            return True
        with self._lock:
            self._event("failed", info.key, None, "no tier admits it and has room")
        return False

    def _demote(self, placement: Placement) -> None:
        """Move an entry to the next lower tier that admits it and has room, or evict it."""
        source = placement.tier
        for index in range(source + 1, len(self.tiers)):
            if not self.policy.admits(placement, self.profiles[index]):
                continue
            if self._move(placement.key, index, f"{self.tier_names[source]} full"):
                return
            with self._lock:
                if self._placed.get(placement.key) is not placement:
                    return  # the entry turned out to be gone
        reason = "bottom tier full" if source == len(self.tiers) - 1 else "no lower tier admits it or has room"
        self._remove_everywhere(placement.key, reason, evicted=True)

    def _move(self, key: str, target: int, reason: str, entry: Entry | None = None, report_no_room: bool = False) -> bool:
        """Copy an entry to tier ``target`` and drop it from its tier (kept there if that tier is shared).

        Demoting to the tier that already holds the entry's write-behind copy writes nothing.
        """
        with self._lock:
            placement = self._placed.get(key)
            if placement is None:
                return False
            source = placement.tier
            if target == source:
                return True
        has_copy = placement.copy_in == target and self.tiers[target].contains(key)
        if entry is None and not has_copy:
            entry = self.tiers[source].peek(key)
            if entry is None:
                with self._lock:
                    self._forget(placement, f"gone from {self.tier_names[source]}")
                return False
        if entry is not None and not has_copy:
            with self._lock:
                victims = self._reserve_room(target, entry.size)
                if victims is None and report_no_room:
                    self._event("failed", key, target, f"no room in {self.tier_names[target]}", source)
            if victims is None:
                return False
            try:
                self._make_room(victims)
                written = self.tiers[target].put_entry(entry)
            finally:
                self._unreserve(target, entry.size)
            if not written:
                with self._lock:
                    self._event("failed", key, target, f"write to {self.tier_names[target]} failed", source)
                return False
        kept = self.tiers[source].shared
        with self._lock:
            placement.copy_in = source if kept and target < source and self.tiers[source].persistent else None
            placement.tier = target
            self._placed[key] = placement  # also when the source tier evicted it meanwhile: the copy is here
            self._event("promoted" if target < source else "demoted", key, target, reason, source)
        if not kept:
            self.tiers[source].delete(key)
        return True

    def _save_volatile(self) -> None:
        """Move entries of tiers that die with the process down to a persistent tier with room."""
        persistent = [i for i, tier in enumerate(self.tiers) if tier.persistent]
        with self._lock:
            placements = list(self._placed.values())
        for placement in placements:
            with self._claim(placement.key):
                with self._lock:
                    current = self._placed.get(placement.key) is placement
                if not current or self.tiers[placement.tier].persistent:
                    continue
                for index in ([placement.copy_in] if placement.copy_in is not None else []) + persistent:
                    if index > placement.tier and self._move(placement.key, index, "saved on close"):
                        break

    def _remove_everywhere(self, key: str, reason: str, evicted: bool = False) -> bool:
        """Remove ``key`` from its tier, its write-behind copy and every shared tier.

        ``evicted``: it leaves to make room, which the tiers count as evictions.
        """
        with self._lock:
            placement = self._placed.pop(key, None)
            self._pinned.discard(key)
        removed = False
        for index, tier in enumerate(self.tiers):
            if tier.shared or (placement is not None and index in (placement.tier, placement.copy_in)):
                removed = tier.delete(key, evicted=reason if evicted else None) or removed
        if placement is not None or removed:
            with self._lock:
                self._event("evicted", key, None if placement is None else placement.tier, reason)
        return removed or placement is not None

    # --- write-behind -------------------------------------------------------------

    def _persist_target(self, placement: Placement) -> int | None:
        """The persistent tier below a volatile entry that its write-behind copy goes to, or None."""
        if self.tiers[placement.tier].persistent:
            return None
        for index in range(placement.tier + 1, len(self.tiers)):
            if self.tiers[index].persistent and self.policy.admits(placement, self.profiles[index]):
                return index
        return None

    def _persist(self, key: str) -> bool | None:
        """Give a volatile entry its copy in a persistent tier, writing outside the lock; None if none is due."""
        with self._claim(key):
            with self._lock:
                placement = self._placed.get(key)
                target = None if placement is None or placement.copy_in is not None else self._persist_target(placement)
                source = None if placement is None or target is None or self.read_only else self.tiers[placement.tier]
            record = None if source is None else source.read_record(key)
            if record is None or placement is None or target is None:
                return None  # deleted, moved or already copied since it was queued
            try:
                entry = unwrap(record, key)
            except CorruptEntryError:
                return None  # damaged: not copied, and left for a reader to find, log and drop
            staged = self.tiers[target].stage_entry(entry)
            with self._lock:
                victims = self._reserve_room(target, entry.size)
            written: bool | None
            if victims is None:
                staged.abort()
                written = False
            else:
                try:
                    self._make_room(victims)
                    written = staged.commit()
                finally:
                    self._unreserve(target, entry.size)
            with self._lock:
                if written and self._placed.get(key) is placement and placement.tier < target:
                    placement.copy_in = target
                elif written:
                    written = None  # the entry left its volatile tier meanwhile (evicted by it): no copy is due
                else:
                    reason = f"write-behind to {self.tier_names[target]} failed"
                    self._event("failed", key, target, reason, placement.tier)
        self._flush_events()
        return written

    def _tier_evicted(self, index: int, keys: list[str], reason: str) -> None:
        """Tier ``index`` evicted ``keys`` by itself: drop them (or their write-behind copies) from the index."""
        with self._lock:
            for key in keys:
                placement = self._placed.get(key)
                if placement is not None and placement.tier == index:
                    del self._placed[key]
                    self._pinned.discard(key)
                    self._event("evicted", key, index, reason)
                elif placement is not None and placement.copy_in == index:
                    placement.copy_in = None  # the entry itself is still above

    def _forget(self, placement: Placement, reason: str) -> None:
        """Drop an index entry whose record is no longer in its tier (another process or the tier removed it)."""
        if self._placed.get(placement.key) is placement:
            del self._placed[placement.key]
            self._pinned.discard(placement.key)
            log.info("%s: %r %s; treated as a miss", self.name, placement.key, reason)
            self._event("evicted", placement.key, placement.tier, reason)

    def _locate(self, key: str) -> Placement | None:
        """The placement of ``key``, asking the shared tiers (outside the lock) when the index does not know it.

        A placement in a shared tier is checked there: another process may have removed the entry.
        """
        with self._lock:
            placement = self._placed.get(key)
        if placement is not None:
            if not self.tiers[placement.tier].shared or self.tiers[placement.tier].contains(key):
                return placement
            with self._lock:
                self._forget(placement, f"gone from {self.tier_names[placement.tier]}")
        for index in self._shared_tiers():
            info = self.tiers[index].info(key)
            if info is not None:
                with self._lock:
                    return self._placed.get(key) or self._register(info, index)
        return None

    def _register(self, info: EntryInfo, index: int) -> Placement:
        """Index an entry found in tier ``index`` (lock held)."""
        placement = Placement(info.key, index, info.size, info.tokens, time.monotonic())
        self._placed[info.key] = placement
        return placement

    # --- reads ----------------------------------------------------------------

    def _fetch(self, key: str, to_top: bool, reason: str) -> Entry | None:
        """Read ``key`` from its tier (outside the lock), then move it to the top if asked."""
        for _ in range(_READ_ATTEMPTS):
            with self._lock:
                seen = self._placed.get(key)
                where = [seen.tier] if seen is not None else self._shared_tiers()
            for index in where:
                start = time.perf_counter()
                entry = self.tiers[index].get_entry(key)
                if entry is None:
                    continue
                self.profiles[index].observe(entry.size, time.perf_counter() - start)
                with self._lock:
                    current = self._placed.get(key)
                    if current is None and seen is None:
                        current = self._register(entry, index)
                    unchanged = current is not None and (seen is None or current is seen) and current.tier == index
                    if current is not None and unchanged:
                        current.hits += 1
                        current.last_access = time.monotonic()
                    promote = unchanged and to_top and index > 0 and key not in self._claimed
                    if promote:
                        self._claimed.add(key)  # a key being moved is not promoted: this read does not wait
                if promote:
                    try:
                        self._move(key, 0, reason, entry)
                    finally:
                        self._release([key])
                return entry
            with self._lock:
                if seen is None or self.read_only:  # read-only: a damaged entry stays, indexed where it is
                    return None
                if self._placed.get(key) is seen and seen.tier == where[0]:
                    self._forget(seen, f"gone from {self.tier_names[seen.tier]} (expired, evicted, damaged or unreachable)")
        return None

    def _prefetch_one(self, key: str) -> bool:
        with self._lock:
            placement = self._placed.get(key)
            if placement is not None and placement.tier == 0:
                return True
        try:
            entry = self._fetch(key, to_top=True, reason="prefetched")
            with self._lock:
                placement = self._placed.get(key)
                at_top = entry is not None and placement is not None and placement.tier == 0
        except Exception:  # noqa: BLE001 - a prefetch runs in a pool thread: logged, reported as False
            log.exception("%s: prefetch of %r failed", self.name, key)
            return False
        finally:
            self._flush_events()
        return at_top

    # --- helpers --------------------------------------------------------------

    def _index_tiers(self) -> None:
        """Index what the non-shared tiers already hold; a key found twice keeps its highest copy."""
        for index, tier in enumerate(self.tiers):
            if tier.shared:
                continue
            for key in tier.keys():  # coldest first, so recency order carries over
                info = tier.info(key)
                if info is None:
                    continue
                if key in self._placed:
                    tier.delete(key)
                else:
                    self._register(info, index)

    def _shared_tiers(self) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t.shared]

    def _check_key_open(self, key: str) -> None:
        check_key(key)
        self._check_open()

    def _event(self, kind: str, key: str, tier: int | None, reason: str = "", from_tier: int | None = None) -> None:
        self.events.emit(StoreEvent(
            kind, key,
            None if tier is None else self.tier_names[tier],
            reason,
            None if from_tier is None else self.tier_names[from_tier],
        ))

    def _tier_event(self, kind: str, key: str, reason: str = "") -> None:
        """A stack reports its own moves (``_event``), not the single-tier events of ``Store``."""

    def _flush_events(self) -> None:
        self.events.deliver()


def _unique_names(names: list[str]) -> list[str]:
    """Tier names, numbered where several tiers share one (``file``, ``file2``)."""
    counts = Counter(names)
    seen: Counter[str] = Counter()
    unique = []
    for name in names:
        seen[name] += 1
        unique.append(name if counts[name] == 1 or seen[name] == 1 else f"{name}{seen[name]}")
    return unique


class _WriteBehind:
    """A bounded queue of keys whose entries need a persistent copy, and the thread that writes them."""

    def __init__(self, store: TieredStore, limit: int) -> None:
        self.limit = limit
        self._store = store
        self._queue: queue.Queue[str | None] = queue.Queue(limit)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._counts = Counter({"written": 0, "failed": 0, "written_by_caller": 0})

    def submit(self, key: str) -> None:
        """Queue ``key``; when the queue is full, write its copy in the calling thread (back-pressure)."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvtool-write-behind", daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait(key)
        except queue.Full:
            self._write(key, "written_by_caller")

    def flush(self) -> None:
        self._queue.join()

    def close(self, drain: bool) -> None:
        """Stop the thread, after writing what is queued if ``drain``."""
        if self._thread is None:
            return
        if not drain:
            while True:
                try:
                    self._queue.get_nowait()
                    self._queue.task_done()
                except queue.Empty:
                    break
        self._queue.put(None)
        self._thread.join()

    def stats(self) -> dict[str, int]:
        return {"limit": self.limit, "queued": self._queue.qsize(), **self._counts}

    def _run(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                self._write(key, "written")
            finally:
                self._queue.task_done()

    def _write(self, key: str, counter: str) -> None:
        try:
            written = self._store._persist(key)
        except Exception:  # noqa: BLE001 - the write-behind thread must outlive one failed copy
            log.exception("%s: write-behind of %r failed", self._store.name, key)
            written = False
        if written is not None:
            self._counts[counter if written else "failed"] += 1
