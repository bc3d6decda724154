"""Entry sizes in least-recently-used order, bounded by a byte capacity."""

from __future__ import annotations

from collections import OrderedDict


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

    def admit(self, key: str, size: int) -> list[str]:
        """Record ``key`` as the most recent entry; return the coldest keys dropped to stay in capacity.

        The caller has checked that ``size`` alone fits the capacity.
        """
        self.remove(key)
        victims = self.shrink(to=None if self.capacity is None else self.capacity - size)
        self._sizes[key] = size
        self.used += size
        return victims

    def shrink(self, to: int | None = None) -> list[str]:
        """Drop coldest keys until at most ``to`` (default: the capacity) bytes are used."""
        limit = self.capacity if to is None else to
        victims = []
        while limit is not None and self.used > limit and self._sizes:
            key, size = self._sizes.popitem(last=False)
            self.used -= size
            victims.append(key)
        return victims
