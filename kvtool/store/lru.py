"""Entry sizes in least-recently-used order, bounded by a byte capacity."""

from __future__ import annotations

from collections import OrderedDict
from typing import Container


class LruSizes:
    """Not thread-safe on its own: the store holding it serialises access."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.used = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[str]:
        """Coldest first."""
        return list(self._sizes)

    def touch(self, key: str) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def remove(self, key: str) -> bool:
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self.used -= size
        return True

    def fits(self, key: str, size: int) -> bool:
        """Whether ``size`` bytes under ``key`` (replacing its old size) fit without dropping anything."""
        return self.capacity is None or self.used - self._sizes.get(key, 0) + size <= self.capacity

    def admit(self, key: str, size: int, keep: Container[str] = ()) -> list[str] | None:
        """Record ``key`` as the most recent entry; return the coldest keys dropped to stay in capacity.

        Keys in ``keep`` (pinned) are never dropped: when the entry fits only by
        dropping one of them, nothing changes and None is returned. The caller
        has checked that ``size`` alone fits the capacity.
        """
        victims: list[str] = []
        if self.capacity is not None:
            used = self.used - self._sizes.get(key, 0)
            for candidate, held in self._sizes.items():  # coldest first
                if used + size <= self.capacity:
                    break
                if candidate != key and candidate not in keep:
                    victims.append(candidate)
                    used -= held
            if used + size > self.capacity:
                return None
        self.remove(key)
        for victim in victims:
            self.remove(victim)
        self._sizes[key] = size
        self.used += size
        return victims
