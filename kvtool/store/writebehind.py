"""Write-behind for ``TieredStore``: a bounded queue of keys whose entries need a persistent copy.

One thread takes keys off the queue and calls ``persist(key)``, which writes
the copy (True), fails to (False) or finds none due any more (None: the entry
was deleted, moved or copied since it was queued). When the queue is full,
``submit`` calls ``persist`` in the caller's thread instead (back-pressure), so
at most ``limit`` entries wait for their copy at any moment.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from typing import Callable

log = logging.getLogger("kvtool.store")

Persist = Callable[[str], "bool | None"]


class WriteBehind:
    """The queue and its thread; ``persist`` is the store's routine that writes one key's copy."""

    def __init__(self, limit: int, persist: Persist, owner: str) -> None:
        self.limit = limit
        self._persist = persist
        self._owner = owner  # the store's name, for log messages
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
            written = self._persist(key)
        except Exception:  # the write-behind thread must outlive one failed copy
            log.exception("%s: write-behind of %r failed", self._owner, key)
            written = False
        if written is not None:
            self._counts[counter if written else "failed"] += 1
