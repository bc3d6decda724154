"""Safe file access: atomic writes, and reads that refuse what is not a regular file.

A reader of an atomic write sees the old file or the whole new one, never a
part. Input paths are checked to be regular files before they are read, so a
FIFO, a device such as ``/dev/zero`` or a directory is refused at once instead
of blocking or filling memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import stat
from pathlib import Path
from typing import BinaryIO, Iterator

from kvtool.errors import UsageError

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def check_regular(path: str | os.PathLike[str]) -> None:
    """Raise ``UsageError`` unless ``path`` is a regular file (following symlinks); never blocks."""
    _require_regular(path, os.stat(path).st_mode)


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Open an existing regular file for reading; a FIFO or device is refused without blocking on it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _require_regular(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _require_regular(path: str | os.PathLike[str], mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise UsageError(f"{os.fspath(path)}: not a regular file ({_KINDS.get(stat.S_IFMT(mode), 'a special file')})")


def check_output(path: str | os.PathLike[str]) -> None:
    """Raise ``UsageError`` unless ``path`` can be written as a file: its folder exists, and it is not a
    directory (nor a link to one, which a rename would replace by the file)."""
    path = Path(path)
    if path.is_dir():
        link = " (a symbolic link to a directory)" if path.is_symlink() else ""
        raise UsageError(f"the output {path} is a directory{link}; name a file in it")
    if not path.parent.is_dir():
        why = "is not a directory" if path.parent.exists() else "does not exist"
        raise UsageError(f"cannot write {path}: the folder {path.parent} {why}")


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Write to a temporary file beside ``path``; fsync and rename it into place on success.

    On any exception the temporary file is removed and ``path`` is left untouched.
    The temporary file is locked (``flock``) while it is written, so one left by a
    killed process is recognised, unlocked, and removed by the next write in the same folder.
    """
    path = Path(path)
    check_output(path)
    _remove_abandoned_parts(path.parent)
    token = secrets.token_hex(6)
    tmp = path.parent / f".{path.name}.{token}.part"
    # Locked under another name first, so no file named .part is ever unlocked while its writer lives.
    # os.open applies the umask to 0o666, as an ordinary new file gets; an existing file keeps its mode.
    new = path.parent / f".{path.name}.{token}.new"
    fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(new, tmp)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(new)
        raise
    try:
        if path.exists():
            os.fchmod(fd, path.stat().st_mode & 0o7777)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)  # before the close releases the lock
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


#: The temporary file of an atomic write: ``.NAME.<12 hex digits>.part``.
_PART = re.compile(r"\..+\.[0-9a-f]{12}\.part", re.DOTALL)


def _remove_abandoned_parts(folder: Path) -> None:
    """Remove temporary files of earlier writes in ``folder`` whose writer died (their lock is free)."""
    with contextlib.suppress(OSError):
        for candidate in folder.glob(".*.part"):
            if _PART.fullmatch(candidate.name):
                _remove_if_unlocked(candidate)


def _remove_if_unlocked(part: Path) -> None:
    try:
        fd = os.open(part, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.path.exists(part) and os.path.samestat(os.fstat(fd), os.stat(part)):
            os.unlink(part)
    except OSError:  # locked: its writer is alive
        return
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in ``directory`` durable."""
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
