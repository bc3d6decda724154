"""The moves of a ``TieredStore``: placing, demoting, promoting and persisting entries between its tiers.

``TierMoves`` holds the stack's tiers, its ``Placements`` and its policy, and
the routines that move entries: one copy routine (``_copy``: make room in the
target tier, then write) serves placing a new entry, moving one and writing a
write-behind copy. ``TieredStore`` (``kvtool.store.tiered``) adds the public
calls. No tier I/O happens under a lock.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from typing import Callable, Concatenate, ParamSpec, TypeVar

from kvtool.store.base import Store, log
from kvtool.store.entry import CorruptEntryError, Entry, EntryInfo, check_key, unwrap
from kvtool.store.events import StoreEvent
from kvtool.store.placements import Placements, TierRoom
from kvtool.store.policy import Placement, Policy, TierProfile

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S", bound=Store)


def delivering_events(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Run ``method`` inside ``events.delivering()``: its events reach subscribers when it returns."""

    @functools.wraps(method)
    def run(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.events.delivering():
            return method(self, *args, **kwargs)

    return run


class TierMoves(Store):
    """Tiers, their placements and the moves between them; ``TieredStore`` is the public face."""

    _tiers: list[Store]
    _tier_names: list[str]
    policy: Policy
    profiles: list[TierProfile]
    _placements: Placements

    @property
    def tiers(self) -> list[Store]:
        return self._tiers

    @property
    def tier_names(self) -> list[str]:
        return self._tier_names

    # --- room, and the one copy routine ----------------------------------------

    def _copy(self, target: int, need: int, write: Callable[[], bool]) -> bool | None:
        """Make ``need`` bytes of room in tier ``target`` and ``write`` there; None when no room can be made.

        The entries that must leave first are demoted (or evicted) before the
        write, outside any lock; the room stays reserved until the write ends.
        """
        tier = self._tiers[target]
        room = TierRoom(tier.capacity, tier.used_bytes or 0, tier.shared, target == len(self._tiers) - 1)
        profile = self.profiles[target]
        with self._placements.reserve(target, need, room,
                                      lambda ps: self.policy.coldest_first(ps, profile, time.monotonic())) as victims:
            if victims is None:
                return None
            for victim in victims:
                try:
                    self._demote(victim)
                finally:
                    self._placements.left(target, victim)
            return write()

    # --- placement (no lock held; the caller has claimed the key) -------------

    def _place(self, info: EntryInfo, record: bytes) -> bool:
        """Put a new record in the highest tier that admits it and has room."""
        old = self._placements.get(info.key)
        placement = Placement(info.key, -1, info.size, info.tokens, time.monotonic())
        for index, tier in enumerate(self._tiers):
            if not self.policy.admits(placement, self.profiles[index]):
                continue
            need = info.size - (old.size if old is not None and old.tier == index else 0)
            write = (functools.partial(tier.put_entry, info) if isinstance(info, Entry)
                     else functools.partial(tier.write_record, info.key, record))
            if not self._copy(index, need, write):
                continue
            placement.tier = index
            self._placements.set(placement)
            self._event("stored", info.key, index)
            for stale in ({old.tier, old.copy_in} - {index, None} if old is not None else set()):
                if stale is not None:
                    self._tiers[stale].delete(info.key)  # the old value must not outlive the new one
            return True
        self._event("failed", info.key, None, "no tier admits it and has room")
        return False

    def _demote(self, placement: Placement) -> None:
        """Move an entry to the next lower tier that admits it and has room, or evict it."""
        source = placement.tier
        for index in range(source + 1, len(self._tiers)):
            if not self.policy.admits(placement, self.profiles[index]):
                continue
            if self._move(placement.key, index, f"{self.tier_names[source]} full"):
                return
            if not self._placements.is_current(placement):
                return  # the entry turned out to be gone
        reason = "bottom tier full" if source == len(self._tiers) - 1 else "no lower tier admits it or has room"
        self._remove_everywhere(placement.key, reason, evicted=True)

    def _move(self, key: str, target: int, reason: str, entry: Entry | None = None, report_no_room: bool = False) -> bool:
        """Copy an entry to tier ``target`` and drop it from its tier (kept there if that tier is shared).

        Demoting to the tier that already holds the entry's write-behind copy writes nothing.
        """
        placement = self._placements.get(key)
        if placement is None:
            return False
        source = placement.tier
        if target == source:
            return True
        has_copy = placement.copy_in == target and self._tiers[target].contains(key)
        if entry is None and not has_copy:
            entry = self._tiers[source].peek(key)
            if entry is None:
                self._forget(placement, f"gone from {self.tier_names[source]}")
                return False
        if entry is not None and not has_copy:
            written = self._copy(target, entry.size, functools.partial(self._tiers[target].put_entry, entry))
            if written is None and report_no_room:
                self._event("failed", key, target, f"no room in {self.tier_names[target]}", source)
            if written is False:
                self._event("failed", key, target, f"write to {self.tier_names[target]} failed", source)
            if not written:
                return False
        kept = self._tiers[source].shared
        with self._placements.lock:
            placement.copy_in = source if kept and target < source and self._tiers[source].persistent else None
            placement.tier = target
            self._placements.set(placement)  # also when the source tier evicted it meanwhile: the copy is here
        self._event("promoted" if target < source else "demoted", key, target, reason, source)
        if not kept:
            self._tiers[source].delete(key)
        return True

    def _save_volatile(self) -> list[str]:
        """Move entries of tiers that die with the process down to a persistent tier with room.

        Returns the keys no persistent tier took (full, refusing or failing): they are lost with the
        process, and each is reported (a warning naming how many, and an ``evicted`` event).
        """
        persistent = [i for i, tier in enumerate(self._tiers) if tier.persistent]
        lost: list[str] = []
        for placement in self._placements.snapshot():
            with self._placements.claim(placement.key):
                if not self._placements.is_current(placement) or self._tiers[placement.tier].persistent:
                    continue
                below = [i for i in ([placement.copy_in] if placement.copy_in is not None else []) + persistent
                         if i > placement.tier]
                if below and not any(self._move(placement.key, index, "saved on close") for index in below):
                    lost.append(placement.key)
                    self._event("evicted", placement.key, placement.tier, "lost on close: no persistent tier took it")
        if lost:
            log.warning("%s: %d entries held only in %s were lost on close: no persistent tier took them "
                        "(full, too small or failing); first: %s", self.name, len(lost),
                        " and ".join(sorted({self.tier_names[i] for i, t in enumerate(self._tiers) if not t.persistent})),
                        ", ".join(repr(k) for k in lost[:3]))
        return lost

    def _remove_everywhere(self, key: str, reason: str, evicted: bool = False) -> bool:
        """Remove ``key`` from its tier, its write-behind copy and every shared tier.

        ``evicted``: it leaves to make room, which the tiers count as evictions.
        """
        placement = self._placements.pop(key)
        removed = False
        for index, tier in enumerate(self._tiers):
            if tier.shared or (placement is not None and index in (placement.tier, placement.copy_in)):
                removed = tier.delete(key, evicted=reason if evicted else None) or removed
        if placement is not None or removed:
            self._event("evicted", key, None if placement is None else placement.tier, reason)
        return removed or placement is not None

    # --- write-behind -------------------------------------------------------------

    def _persist_target(self, placement: Placement) -> int | None:
        """The persistent tier below a volatile entry that its write-behind copy goes to, or None."""
        if self._tiers[placement.tier].persistent:
            return None
        for index in range(placement.tier + 1, len(self._tiers)):
            if self._tiers[index].persistent and self.policy.admits(placement, self.profiles[index]):
                return index
        return None

    @delivering_events
    def _persist(self, key: str) -> bool | None:
        """Give a volatile entry its copy in a persistent tier (``WriteBehind``'s routine); None if none is due."""
        with self._placements.claim(key):
            placement = self._placements.get(key)
            target = None if placement is None or placement.copy_in is not None else self._persist_target(placement)
            source = None if placement is None or target is None or self.read_only else self._tiers[placement.tier]
            record = None if source is None else source.read_record(key)
            if record is None or placement is None or target is None:
                return None  # deleted, moved or already copied since it was queued
            try:
                entry = unwrap(record, key)
            except CorruptEntryError:
                return None  # damaged: not copied, and left for a reader to find, log and drop
            staged = self._tiers[target].stage_entry(entry)
            written = self._copy(target, entry.size, staged.commit)
            if written is None:
                staged.abort()
            with self._placements.lock:
                if written and self._placements.is_current(placement) and placement.tier < target:
                    placement.copy_in = target
                    return True
                if written:
                    return None  # the entry left its volatile tier meanwhile (evicted by it): no copy is due
            self._event("failed", key, target, f"write-behind to {self.tier_names[target]} failed", placement.tier)
            return False

    # --- the index, kept in step with the tiers -----------------------------------

    def _tier_evicted(self, index: int, keys: list[str], reason: str) -> None:
        """Tier ``index`` evicted ``keys`` by itself: drop them (or their write-behind copies) from the index."""
        for key in keys:
            with self._placements.lock:
                placement = self._placements.get(key)
                if placement is not None and placement.tier == index:
                    self._placements.pop(key)
                    self._event("evicted", key, index, reason)
                elif placement is not None and placement.copy_in == index:
                    placement.copy_in = None  # the entry itself is still above

    def _forget(self, placement: Placement, reason: str) -> None:
        """Drop an index entry whose record is no longer in its tier (another process or the tier removed it)."""
        if self._placements.forget(placement):
            log.info("%s: %r %s; treated as a miss", self.name, placement.key, reason)
            self._event("evicted", placement.key, placement.tier, reason)

    def _locate(self, key: str) -> Placement | None:
        """The placement of ``key``, asking the shared tiers (outside the lock) when the index does not know it.

        A placement in a shared tier is checked there: another process may have removed the entry.
        """
        placement = self._placements.get(key)
        if placement is not None:
            if not self._tiers[placement.tier].shared or self._tiers[placement.tier].contains(key):
                return placement
            self._forget(placement, f"gone from {self.tier_names[placement.tier]}")
        for index in self._shared_tiers():
            info = self._tiers[index].info(key)
            if info is not None:
                with self._placements.lock:
                    return self._placements.get(key) or self._placements.register(info, index)
        return None

    # --- helpers --------------------------------------------------------------

    def _index_tiers(self) -> None:
        """Index what the non-shared tiers already hold; a key found twice keeps its highest copy."""
        for index, tier in enumerate(self._tiers):
            if tier.shared:
                continue
            for key in tier.keys():  # coldest first, so recency order carries over
                info = tier.info(key)
                if info is None:
                    continue
                if self._placements.get(key) is not None:
                    tier.delete(key)
                else:
                    self._placements.register(info, index)

    def _shared_tiers(self) -> list[int]:
        return [i for i, t in enumerate(self._tiers) if t.shared]

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



def unique_names(names: list[str]) -> list[str]:
    """Tier names, numbered where several tiers share one (``file``, ``file2``)."""
    counts = Counter(names)
    seen: Counter[str] = Counter()
    unique = []
    for name in names:
        seen[name] += 1
        unique.append(name if counts[name] == 1 or seen[name] == 1 else f"{name}{seen[name]}")
    return unique
