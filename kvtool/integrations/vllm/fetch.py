"""Reading one entry for a restore, with the cause when there is none: missing or damaged."""

from __future__ import annotations

from typing import Literal

from kvtool.store import Entry, Store, TieredStore

MissCause = Literal["missing", "damaged"]


def fetch_entry(store: Store, key: str) -> tuple[Entry | None, MissCause | None]:
    """The entry under ``key`` and None, or None and why it is not there.

    A damaged record reads as a miss; it is told from an absent one by the
    store's count of damaged records before and after the read, which holds
    while the worker's restore thread is the store's only reader in this process.
    Store errors (a tier that is down) propagate as ``KvtoolError``.
    """
    damaged_before = _damaged_count(store)
    entry = store.get_entry(key)
    if entry is not None:
        return entry, None
    return None, "damaged" if _damaged_count(store) > damaged_before else "missing"


def _damaged_count(store: Store) -> int:
    """Damaged records the store (and its tiers) found so far."""
    tiers = store.tiers if isinstance(store, TieredStore) else [store]
    return sum(tier.metrics.snapshot()["corrupt"] for tier in tiers)
