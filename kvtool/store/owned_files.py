"""The file store's own files: opened only when they are regular files, and never in a way that blocks.

Anything can appear in a store's directory (a FIFO, a socket, a device node, a
symlink, made by mistake or by someone else). Opening a FIFO for reading
blocks until a writer comes, so every open here uses ``O_NONBLOCK`` and
``O_NOFOLLOW`` and checks ``fstat`` for a regular file before anything is read
or locked; what is not one raises ``NotRegularFile``, which callers skip and
report.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from pathlib import Path

from kvtool.store.entry import CorruptEntryError

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symbolic link",
}


class NotRegularFile(CorruptEntryError):
    """A path where the store expects one of its files holds something else (FIFO, socket, device, link)."""


def open_owned(path: Path) -> int:
    """A read-only descriptor of ``path`` if it is a regular file (not a link); ``NotRegularFile`` otherwise.

    Never blocks: a FIFO is opened non-blocking and refused.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.ENODEV):  # a link, a socket, a device without driver
            with contextlib.suppress(OSError):
                _require_regular(path, os.lstat(path).st_mode)
        raise
    try:
        _require_regular(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _require_regular(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "a special file")
        raise NotRegularFile(f"{path.name} is {kind}, not a file of this store")


def read_exactly(path: Path, size: int) -> bytes:
    """The file's bytes, if it is a regular file of exactly the ``size`` the index recorded (checked first)."""
    fd = open_owned(path)
    with os.fdopen(fd, "rb") as f:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise CorruptEntryError(f"length mismatch: the file has {actual} bytes, the index says {size}")
        return f.read()


def abandoned(path: Path, grace_s: float) -> bool:
    """True if ``path`` is a regular file older than ``grace_s`` whose write lock no process holds.

    ``NotRegularFile`` if it is not a regular file (never opened in a way that blocks).
    """
    try:
        fd = open_owned(path)
    except NotRegularFile:
        raise
    except OSError:
        return False
    try:
        if time.time() - os.fstat(fd).st_mtime < grace_s:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # also releases the lock just taken


def listdir(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except OSError:
        return []


def unlink(path: Path) -> int:
    try:
        path.unlink()
        return 1
    except FileNotFoundError:
        return 0
