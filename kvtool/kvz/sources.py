"""Where a reader's bytes come from: a file (positioned reads) or a buffer in memory."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Protocol, Union

from kvtool.fileio import open_regular
from kvtool.kvz.format import KvzCorruptError

Buffer = Union[bytes, bytearray, memoryview]
#: The batch read path fetches chunks in runs of about this many stored bytes.
READ_RUN = 4 << 20


class ByteSource(Protocol):
    """What a ``KvzReader`` reads from. ``read`` returns exactly ``length`` bytes or raises
    ``KvzCorruptError``; ``read_run`` may return a buffer that the calling thread reuses for its
    next ``read_run`` (valid until then)."""

    size: int
    bytes_read: int

    def read(self, offset: int, length: int) -> Buffer: ...

    def read_run(self, offset: int, length: int) -> Buffer: ...

    def close(self) -> None: ...


class FileSource:
    """Positioned reads from a regular file, counting what was read."""

    def __init__(self, path: str | os.PathLike[str]):
        self._f = open_regular(Path(path))
        self.size = os.fstat(self._f.fileno()).st_size
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._buffers = threading.local()

    def read(self, offset: int, length: int) -> bytes:
        data = os.pread(self._f.fileno(), length, offset)
        self._count(len(data), offset, length)
        return data

    def read_run(self, offset: int, length: int) -> memoryview:
        """Like ``read``, into a buffer this thread reuses: a fresh buffer per run would cost a page
        fault per 4 KiB. It grows (doubling, up to ``READ_RUN``) to the largest run read, and shrinks
        back after one over ``READ_RUN``."""
        buf: bytearray | None = getattr(self._buffers, "buf", None)
        if buf is None or len(buf) < length or (len(buf) > READ_RUN and length <= READ_RUN):
            size = max(length, min(2 * len(buf), READ_RUN)) if buf is not None else length
            buf = self._buffers.buf = None  # the old one goes before the new one comes
            buf = self._buffers.buf = bytearray(size)
        view = memoryview(buf)[:length]
        self._count(os.preadv(self._f.fileno(), [view], offset), offset, length)
        return view

    def _count(self, got: int, offset: int, length: int) -> None:
        with self._lock:
            self.bytes_read += got
        if got != length:
            raise KvzCorruptError(f"file ends early: wanted {length} bytes at {offset}, got {got}")

    def close(self) -> None:
        self._buffers = threading.local()
        self._f.close()


class BytesSource:
    """Reads from bytes already in memory: views, never copies."""

    def __init__(self, data: Buffer):
        self._data = memoryview(data).cast("B")
        self.size = len(self._data)
        self.bytes_read = 0

    def read(self, offset: int, length: int) -> memoryview:
        if offset + length > self.size:
            raise KvzCorruptError(f"data ends early: wanted {length} bytes at {offset}, got {max(self.size - offset, 0)}")
        self.bytes_read += length
        return self._data[offset : offset + length]

    def read_run(self, offset: int, length: int) -> memoryview:
        return self.read(offset, length)

    def close(self) -> None:
        self._data.release()
