"""Calls to make later, on one thread: the prefetches that hints schedule."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Callable

log = logging.getLogger("kvtool.server")


class Later:
    """Run ``fn`` ``delay_s`` seconds from now; a newer call under the same name replaces a pending one."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._pending: dict[str, tuple[int, Callable[[], object]]] = {}
        self._ids = itertools.count()
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def call(self, delay_s: float, name: str, fn: Callable[[], object]) -> None:
        with self._wake:
            if self._closed:
                return
            call_id = next(self._ids)
            self._pending[name] = (call_id, fn)
            heapq.heappush(self._heap, (time.monotonic() + delay_s, call_id, name))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvtool-later", daemon=True)
                self._thread.start()
            self._wake.notify()

    def cancel(self, name: str) -> bool:
        """Drop the pending call under ``name``; True if there was one."""
        with self._wake:
            return self._pending.pop(name, None) is not None

    def pending(self) -> int:
        with self._wake:
            return len(self._pending)

    def close(self) -> None:
        """Drop what is pending and stop the thread."""
        with self._wake:
            self._closed = True
            self._pending.clear()
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._wake.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                if self._closed:
                    return
                _, call_id, name = heapq.heappop(self._heap)
                current = self._pending.get(name)
                if current is None or current[0] != call_id:
                    continue  # replaced by a newer call
                del self._pending[name]
            try:
                current[1]()
            except Exception:
                log.exception("scheduled call %s failed", name)
