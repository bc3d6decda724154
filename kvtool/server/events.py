"""The event stream: store events and the API's own (pin, unpin, hint), fanned out to listeners.

``TieredStore`` calls its subscribers in whichever thread caused an event;
``EventHub.publish`` numbers the event, keeps it in a ring of recent events
(so a client that reconnects with ``Last-Event-ID`` misses nothing the ring
still holds) and hands it to each listener's asyncio queue on the server's
event loop. A listener that falls more than ``queue_size`` events behind is
told how many it lost instead of holding the server's memory.
"""

from __future__ import annotations

import asyncio
import enum
import json
import threading
from collections import deque
from dataclasses import asdict
from typing import Any, AsyncIterator, Final, Union

from kvtool.store import StoreEvent


class _End(enum.Enum):
    """The item that ends a stream: an enum member, so that the type checker tells it from the others."""

    CLOSED = "closed"


_CLOSED: Final = _End.CLOSED
Event = tuple[int, str, str]  # (id, kind, JSON data)
#: What a listener's queue holds: events, the count of events it lost, and ``_CLOSED`` at the end.
Queued = Union[Event, int, _End]


class TooManyListeners(Exception):
    pass


class EventHub:
    def __init__(self, ring_size: int = 4096, queue_size: int = 10_000, max_listeners: int = 64) -> None:
        self._last_id = 0
        self._ring: deque[Event] = deque(maxlen=ring_size)
        self._listeners: dict[asyncio.Queue[Queued], asyncio.AbstractEventLoop] = {}
        self._queue_size = queue_size
        self._max_listeners = max_listeners
        self._lock = threading.Lock()
        self._closed = False

    def publish_store_event(self, event: StoreEvent) -> None:
        self.publish(event.kind, asdict(event))

    def publish(self, kind: str, data: dict[str, Any]) -> None:
        with self._lock:
            self._last_id += 1
            item = (self._last_id, kind, json.dumps(data, separators=(",", ":")))
            self._ring.append(item)
            listeners = list(self._listeners.items())
        _deliver(listeners, item)

    def close(self) -> None:
        """End every stream (the server is shutting down)."""
        with self._lock:
            self._closed = True
            listeners = list(self._listeners.items())
        _deliver(listeners, _CLOSED)

    def open_stream(self, last_id: int | None, heartbeat_s: float = 15.0) -> AsyncIterator[str]:
        """Server-sent events: those after ``last_id`` still in the ring, then live ones; comments as heartbeats.

        Registers the listener at once (``TooManyListeners`` when the server
        has as many as it allows), so a refusal comes before any response.
        """
        queue: asyncio.Queue[Queued] = asyncio.Queue(self._queue_size)
        with self._lock:
            if len(self._listeners) >= self._max_listeners:
                raise TooManyListeners(f"{self._max_listeners} event streams are open; close one first")
            if self._closed:
                queue.put_nowait(_CLOSED)
            self._listeners[queue] = asyncio.get_running_loop()
            replay = [item for item in self._ring if last_id is not None and item[0] > last_id]
            first_kept = self._ring[0][0] if self._ring else self._last_id + 1
        return self._stream(queue, last_id, replay, first_kept, heartbeat_s)

    @property
    def listeners(self) -> int:
        with self._lock:
            return len(self._listeners)

    async def _stream(self, queue: asyncio.Queue[Queued], last_id: int | None, replay: list[Event], first_kept: int,
                      heartbeat_s: float) -> AsyncIterator[str]:
        try:
            yield ": kvtool events\n\n"
            if last_id is not None and last_id + 1 < first_kept:
                yield _format((first_kept - 1, "lost", json.dumps({"count": first_kept - 1 - last_id})))
            sent = replay[-1][0] if replay else last_id or 0
            for event in replay:
                yield _format(event)
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), heartbeat_s)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                if item is _CLOSED:
                    return
                if isinstance(item, int):  # events dropped because this listener fell behind
                    yield _format((sent, "lost", json.dumps({"count": item})))
                elif item[0] > sent:
                    sent = item[0]
                    yield _format(item)
        finally:
            with self._lock:
                self._listeners.pop(queue, None)


def _deliver(listeners: list[tuple[asyncio.Queue[Queued], asyncio.AbstractEventLoop]], item: Queued) -> None:
    for queue, loop in listeners:
        try:
            loop.call_soon_threadsafe(_offer, queue, item)
        except RuntimeError:  # that listener's event loop has stopped
            pass


def _offer(queue: asyncio.Queue[Queued], item: Queued) -> None:
    """Queue ``item``; on overflow, drop the oldest queued items and count them as lost."""
    if queue.full():
        lost = 0
        while queue.qsize() > queue.maxsize // 2:
            dropped = queue.get_nowait()
            lost += dropped if isinstance(dropped, int) else 1
        queue.put_nowait(lost)
    queue.put_nowait(item)


def _format(item: Event) -> str:
    event_id, kind, data = item
    return f"id: {event_id}\nevent: {kind}\ndata: {data}\n\n"
