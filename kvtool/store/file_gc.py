"""Garbage collection of a file store: what crashed writers left behind, removed safely.

A crash can leave files the index does not name (a ``.part``, a renamed file
whose commit never happened, an old record not yet unlinked) and rows whose
file is gone. ``collect`` removes them while other processes use the store: a
file still locked by its writer (the ``flock`` dies with the process), or a
``.part`` younger than the grace period, is left alone.

Two rules keep it from doing harm: what is not a regular file (a FIFO, socket,
device or link named like one of the store's files) is never opened in a way
that blocks, only skipped and counted; and when the index cannot be read
nothing is removed, since an unreadable index does not mean that no file is
named.
"""

from __future__ import annotations

import functools
import logging
import re
import sqlite3
from pathlib import Path
from typing import Iterator

from kvtool.store.file_index import Failed, FileIndex
from kvtool.store.owned_files import NotRegularFile, abandoned, listdir, unlink

log = logging.getLogger("kvtool.store")

RECORD = re.compile(r"(?P<digest>[0-9a-f]{40})-[0-9a-f]{16}\.kve")
PARTIAL = re.compile(r"\.[0-9a-f]{40}-[0-9a-f]{16}\.kve\.part")
SHARD = re.compile(r"[0-9a-f]{2}")


def collect(entries: Path, index: FileIndex, owner: str, grace_s: float) -> dict[str, int]:
    """Remove the garbage under ``entries`` (the store's ``entries/``); counts of what was removed and skipped."""
    counts = {"partial": 0, "orphans": 0, "rows": 0, "skipped": 0}
    present: set[str] = set()
    for shard in shards(entries):
        for path in listdir(shard):
            name = f"{shard.name}/{path.name}"
            if PARTIAL.fullmatch(path.name):
                if _abandoned(entries, name, grace_s, owner, counts):
                    log.info("%s: removing an interrupted write %s", owner, name)
                    counts["partial"] += unlink(path)
            elif RECORD.fullmatch(path.name):
                present.add(name)
    referenced = index.query_or_failed(lambda db: {r[0] for r in db.execute("SELECT file FROM entries")})
    if isinstance(referenced, Failed):
        log.warning("%s: garbage collection skipped: the index cannot be read", owner)
        return counts
    for name in present - referenced:
        # A writer holds its file's lock until its commit is done, so the index is asked after the lock
        # was free: a file that is then still unnamed is garbage (a failed query is not "unnamed").
        if _abandoned(entries, name, 0.0, owner, counts) and (
            index.row_or_failed("SELECT 1 FROM entries WHERE file = ?", name) is None
        ):
            log.info("%s: removing %s, which no index entry names", owner, name)
            counts["orphans"] += unlink(entries / name)
    for name in referenced - present:
        counts["rows"] += index.transaction(functools.partial(_drop_missing, entries=entries, name=name, owner=owner), 0)
    return counts


def shards(entries: Path) -> Iterator[Path]:
    for shard in listdir(entries):
        if SHARD.fullmatch(shard.name) and shard.is_dir():
            yield shard


def _abandoned(entries: Path, name: str, grace_s: float, owner: str, counts: dict[str, int]) -> bool:
    """Whether the file ``name`` is a dead writer's; a special file is skipped and reported, never opened blocking."""
    try:
        return abandoned(entries / name, grace_s)
    except NotRegularFile as exc:
        log.warning("%s: skipping %s: %s", owner, name, exc)
        counts["skipped"] += 1
        return False


def _drop_missing(db: sqlite3.Connection, entries: Path, name: str, owner: str) -> int:
    if (entries / name).exists():  # published after the directory was listed
        return 0
    row = db.execute("SELECT key, size FROM entries WHERE file = ?", (name,)).fetchone()
    if row is None:
        return 0
    log.warning("%s: the file of entry %r is gone; dropping it from the index", owner, row[0])
    db.execute("DELETE FROM entries WHERE file = ?", (name,))
    db.execute("UPDATE totals SET entries = entries - 1, bytes = bytes - ?", (row[1],))
    return 1
