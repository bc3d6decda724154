"""Atomic file writes: a reader sees the old file or the whole new one, never a part."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import BinaryIO, Iterator


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Write to a temporary file beside ``path``; fsync and rename it into place on success.

    On any exception the temporary file is removed and ``path`` is left untouched.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.part"
    # os.open applies the umask to 0o666, as an ordinary new file gets; an existing file keeps its mode.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        if path.exists():
            os.fchmod(fd, path.stat().st_mode & 0o7777)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
