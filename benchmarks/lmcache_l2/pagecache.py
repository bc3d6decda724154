"""The page cache of a folder's files: dropped before a cold load phase, and measured to show it was.

``drop`` writes each file's dirty pages to disk (``fsync``) and asks the kernel to forget
its cached pages (``posix_fadvise(POSIX_FADV_DONTNEED)``): only the files of the L2, not
the whole machine's cache (``/proc/sys/vm/drop_caches``), which would slow every other
process on a shared machine and the servers' own model and code files too.
``resident_bytes`` counts what is still cached (``mincore`` on a mapping of each file, which
reads nothing).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


def files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def drop(folder: Path) -> int:
    """Drop the cached pages of every file under ``folder``; the bytes of the files dropped."""
    total = 0
    for path in files(folder):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # evicted or replaced meanwhile
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def resident_bytes(folder: Path) -> int:
    """Bytes of the folder's files that are in the page cache (whole pages)."""
    return sum(_resident(path) for path in files(folder))


def _resident(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = -(-size // mmap.PAGESIZE)
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(v & 1 for v in vector) * mmap.PAGESIZE
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)
