"""The one way in and out of a store for every integration: put a cache, restore an entry into a destination.

``io`` puts a cache as an entry (coded into its store record with no copy) and
restores one into a destination (``kvtool.destinations``: a buffer, rows at
offsets, paged blocks, GPU pages) with one fetch that names the tier and one
checksum pass per byte, every failure a miss with its cause. ``names`` holds the
store keys of all three integrations (vLLM's block hashes, vLLM's offload
chunks, LMCache's objects), outside the store's generic code. ``probe`` says
at start-up whether a recipe keeps a dtype bit for bit.
"""

from __future__ import annotations

from kvtool.entries.io import Expected, Miss, Opened, PutResult, Restored, open_entry, put_cache, restore_into
from kvtool.entries.probe import recipe_problem

__all__ = ["Expected", "Miss", "Opened", "PutResult", "Restored", "open_entry", "put_cache", "recipe_problem", "restore_into"]
