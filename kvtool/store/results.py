"""What a read found: the entry, or why there is none, as data.

``Store.fetch(key)`` answers with a ``Fetched``: the verified entry, or
``entry=None`` and a ``MissCause`` with a human-readable ``detail``. A hit names
the tier it came from, so a caller that reports it needs no second round trip. A caller
that must act differently on a damaged entry than on a missing one (count it,
report it, recompute without retrying) reads ``cause`` instead of counters or
log text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtool.store.entry import Entry


class MissCause(str, enum.Enum):
    """Why a read found no entry."""

    MISSING = "missing"  # the store does not hold the key (never stored, deleted, evicted, expired)
    DAMAGED = "damaged"  # a record is there but fails its checks (dropped unless the store is read-only)
    UNREACHABLE = "unreachable"  # the backend could not be asked (server down, timeout, I/O or index error)


@dataclass(frozen=True)
class Fetched:
    """The answer to one read: ``entry`` on a hit; otherwise ``cause`` and ``detail`` say why not."""

    key: str
    entry: Entry | None
    cause: MissCause | None
    detail: str = ""
    tier: str | None = None  # on a hit, the name of the tier that held the entry

