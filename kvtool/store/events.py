"""What a store tells its subscribers: an entry stored, moved between tiers, evicted, or a write failed.

Every store has an ``EventBus`` (a plain store is a one-tier stack, so it
reports ``stored``, ``evicted`` and ``failed``; ``TieredStore`` adds
``demoted`` and ``promoted``). Events are collected while an operation runs,
possibly under the store's locks, and delivered when the outermost
``delivering()`` block of the thread ends, with no store lock held, so a
subscriber may call the store.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

log = logging.getLogger("kvtool.store")

EVENT_KINDS = ("stored", "demoted", "promoted", "evicted", "failed")


@dataclass(frozen=True)
class StoreEvent:
    """``kind`` is one of ``EVENT_KINDS``; ``tier`` is where the entry now is (or was, for evicted)."""

    kind: str
    key: str
    tier: str | None
    reason: str = ""
    from_tier: str | None = None


Subscriber = Callable[[StoreEvent], None]


class EventBus:
    """Subscribers, the events waiting for delivery, and how many of each kind there were."""

    def __init__(self, owner: str) -> None:
        self.owner = owner  # the store's name, for log messages
        self._lock = threading.Lock()
        self._subscribers: list[Subscriber] = []
        self._pending: list[StoreEvent] = []
        self._counts: Counter[str] = Counter()
        self._depth = threading.local()

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(event)`` for every event; returns a function that unsubscribes it."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def emit(self, event: StoreEvent) -> None:
        """Count ``event`` and queue it; it is delivered when the thread's ``delivering()`` block ends."""
        with self._lock:
            self._counts[event.kind] += 1
            if self._subscribers:
                self._pending.append(event)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {kind: self._counts[kind] for kind in EVENT_KINDS}

    @contextlib.contextmanager
    def delivering(self) -> Iterator[None]:
        """Deliver the queued events when this block ends (the outermost one of this thread, if nested).

        Enter it before taking any store lock: subscribers run where it ends.
        """
        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        try:
            yield
        finally:
            self._depth.n = depth
            if depth == 0:
                self.deliver()

    def deliver(self) -> None:
        """Call the subscribers with every queued event, in order."""
        with self._lock:
            events, self._pending = self._pending, []
            subscribers = list(self._subscribers)
        for event in events:
            for callback in subscribers:
                try:
                    callback(event)
                except Exception:  # a subscriber's bug must not break the store
                    log.exception("%s: event subscriber %r failed", self.owner, callback)
