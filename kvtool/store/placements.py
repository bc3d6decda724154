"""What a ``TieredStore`` knows of its entries, under one lock: where each is, pins, claims and reservations.

- the index: key -> ``Placement`` (the tier holding it, its size, recency, a
  write-behind copy below);
- pins: keys the stack never demotes or evicts;
- claims: keys a write or move is working on outside the lock (one operation
  per key at a time; ``claim`` waits for the holder);
- reservations: bytes promised, per tier, to writes in progress, and bytes of
  entries on their way out of a tier.

``reserve(tier, need)`` is the one way room is made: it chooses the entries
that must leave the tier first (claimed for the caller, who moves them out),
and gives the room back when the write is done. No tier I/O happens here.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from kvtool.store.entry import EntryInfo
from kvtool.store.policy import Placement


@dataclass(frozen=True)
class TierRoom:
    """What ``reserve`` needs to know of a tier: its capacity and use, whether it evicts by itself."""

    capacity: int | None
    used: int
    shared: bool  # other processes' entries compete for its room: it makes room by itself when written
    bottom: bool  # no lower tier to demote to


Order = Callable[[list[Placement]], list[Placement]]


class Placements:
    """The index, pins, claims and reservations of one stack of ``tiers`` tiers."""

    def __init__(self, tiers: int) -> None:
        self.lock = threading.RLock()  # guards everything below; held for no I/O
        self._released = threading.Condition(self.lock)  # notified when a claim ends
        self._index: dict[str, Placement] = {}
        self._pinned: set[str] = set()
        self._claimed: set[str] = set()
        self._reserved = [0] * tiers
        self._leaving = [0] * tiers

    # --- the index (each call takes the lock; a caller holding it may combine them) ---

    def get(self, key: str) -> Placement | None:
        with self.lock:
            return self._index.get(key)

    def is_current(self, placement: Placement) -> bool:
        """Whether ``placement`` is still the index's entry for its key."""
        with self.lock:
            return self._index.get(placement.key) is placement

    def set(self, placement: Placement) -> None:
        with self.lock:
            self._index[placement.key] = placement

    def register(self, info: EntryInfo, tier: int) -> Placement:
        """Index an entry found in ``tier``."""
        placement = Placement(info.key, tier, info.size, info.tokens, time.monotonic())
        self.set(placement)
        return placement

    def pop(self, key: str) -> Placement | None:
        """Drop ``key`` from the index and its pin; its placement, if it had one."""
        with self.lock:
            self._pinned.discard(key)
            return self._index.pop(key, None)

    def forget(self, placement: Placement) -> bool:
        """Drop ``placement`` if it is still current; whether it was."""
        with self.lock:
            if self._index.get(placement.key) is not placement:
                return False
            self.pop(placement.key)
            return True

    def snapshot(self) -> list[Placement]:
        with self.lock:
            return list(self._index.values())

    def keys_in(self, tiers: Sequence[int]) -> list[str]:
        with self.lock:
            return [key for key, p in self._index.items() if p.tier in tiers]

    def count_by_tier(self) -> Counter[int]:
        with self.lock:
            return Counter(p.tier for p in self._index.values())

    # --- pins ---------------------------------------------------------------------

    def pin(self, placement: Placement) -> bool:
        """Pin ``placement``'s key if the placement is still current."""
        with self.lock:
            if self._index.get(placement.key) is not placement:
                return False
            self._pinned.add(placement.key)
            return True

    def unpin(self, key: str) -> bool:
        with self.lock:
            pinned = key in self._pinned
            self._pinned.discard(key)
            return pinned

    def is_pinned(self, key: str) -> bool:
        with self.lock:
            return key in self._pinned

    def pinned_count(self) -> int:
        with self.lock:
            return len(self._pinned)

    # --- claims -------------------------------------------------------------------

    @contextlib.contextmanager
    def claim(self, key: str) -> Iterator[None]:
        """Hold ``key`` for one write or move, waiting while another operation holds it."""
        with self.lock:
            while key in self._claimed:
                self._released.wait()
            self._claimed.add(key)
        try:
            yield
        finally:
            self.release([key])

    def try_claim(self, key: str) -> bool:
        """Claim ``key`` if no operation holds it; whether it was claimed (never waits)."""
        with self.lock:
            if key in self._claimed:
                return False
            self._claimed.add(key)
            return True

    def release(self, keys: Sequence[str]) -> None:
        with self.lock:
            self._claimed.difference_update(keys)
            self._released.notify_all()

    # --- room ---------------------------------------------------------------------

    @contextlib.contextmanager
    def reserve(self, tier: int, need: int, room: TierRoom, order: Order) -> Iterator[list[Placement] | None]:
        """Reserve ``need`` bytes in ``tier`` while the block runs; yields the entries that must leave it first.

        Yields None when the tier cannot make the room (nothing is reserved
        then). The entries yielded are claimed: the caller moves them out and
        ``left``s each. A shared tier evicts by itself when written (other
        processes' entries compete for its room): entries indexed there are only
        chosen when a lower tier exists, and the tier makes the rest of the room.
        """
        with self.lock:
            victims = self._choose(tier, need, room, order)
            if victims is not None:
                for victim in victims:
                    self._claimed.add(victim.key)
                    self._leaving[tier] += victim.size
                self._reserved[tier] += max(need, 0)
        if victims is None:
            yield None
            return
        try:
            yield victims
        finally:
            with self.lock:
                self._reserved[tier] -= max(need, 0)

    def left(self, tier: int, victim: Placement) -> None:
        """``victim``, chosen by ``reserve``, has been moved out of ``tier`` (or failed to be): release it."""
        with self.lock:
            self._leaving[tier] -= victim.size
        self.release([victim.key])

    def _choose(self, tier: int, need: int, room: TierRoom, order: Order) -> list[Placement] | None:
        if room.capacity is not None and need > room.capacity:
            return None
        victims: list[Placement] = []
        if room.capacity is None or need <= 0:
            return victims
        free = room.capacity - room.used - self._reserved[tier] + self._leaving[tier]
        if free >= need or (room.shared and room.bottom):
            return victims
        candidates = [
            p for p in self._index.values()
            if p.tier == tier and p.key not in self._pinned and p.key not in self._claimed
        ]
        for victim in order(candidates):
            if free >= need:
                break
            victims.append(victim)
            free += victim.size
        if free < need and not room.shared:
            return None
        return victims
