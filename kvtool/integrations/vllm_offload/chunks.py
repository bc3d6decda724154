"""One offload row to a store entry and back, through ``kvtool.entries``: coded from the row, decoded into the row.

``save_row`` cuts the row where vLLM keeps it into ``[kv_heads, tokens, head_dim]``
views (``RowLayout``), codes them with the recipe and stores the result.
``load_row`` restores an entry that holds exactly the arrays a row of this layout
holds straight into the row's own bytes: no intermediate cache. Every failure
(missing, damaged, another shape, a store that is down) is ``False``, a miss,
with the reason logged.
"""

from __future__ import annotations

import logging

import numpy as np

from kvtool.cache import KVCache
from kvtool.destinations import Rows
from kvtool.entries import Expected, put_cache, restore_into
from kvtool.errors import KvtoolError, UsageError
from kvtool.integrations.vllm_offload.rows import RowLayout
from kvtool.store import Store, open_store

log = logging.getLogger("kvtool.vllm.tier")


def row_cache(region: np.ndarray, row: int, layout: RowLayout) -> KVCache:
    """The KV arrays of chunk ``row`` of the region (``[rows, row_stride]`` bytes), as views where the cut allows."""
    flat = region[row, :layout.used_bytes].view(layout.dtype.numpy)
    pairs = layout.split(flat)
    return KVCache([k for k, _ in pairs], [v for _, v in pairs], provenance={"source": "vllm-offload"})


def check_recipe(layout: RowLayout, recipe: str) -> None:
    """Code one block of zeros shaped as this layout's arrays: a recipe that cannot code them fails at startup."""
    heads, _, dim = layout.array_shape
    zeros = np.zeros((heads, layout.block_tokens, dim), layout.dtype.numpy)
    with open_store("memory://") as scratch:
        put = put_cache(scratch, "check", KVCache([zeros], [zeros]), recipe)
    if not put.stored:
        raise UsageError(f"kvtool tier: recipe {recipe!r} cannot code this model's KV: {put.detail}")


def save_row(store: Store, key: str, region: np.ndarray, row: int, layout: RowLayout, recipe: str) -> bool:
    """Code chunk ``row`` with ``recipe`` and store it under ``key``; False if it was not stored."""
    try:
        put = put_cache(store, key, row_cache(region, row, layout), recipe)
    except KvtoolError as exc:
        log.warning("chunk %s not stored: %s", key[-16:], exc)
        return False
    if put.cause == "encode":
        log.warning("chunk %s not stored: %s", key[-16:], put.detail)
    return put.stored


def load_row(store: Store, key: str, region: np.ndarray, row: int, layout: RowLayout, offsets: np.ndarray) -> bool:
    """Restore the entry under ``key`` into chunk ``row`` of the region; False (a miss) if it cannot be.

    ``offsets`` is ``layout.row_offsets()``, computed once.
    """
    expected = Expected(layout.num_arrays, layout.array_shape, layout.dtype.name)
    rows = Rows([region.reshape(-1)], offsets + row * layout.row_stride, [0] * offsets.shape[0])
    restored = restore_into(store, key, expected, rows)
    if not restored.ok:
        assert restored.miss is not None
        log.log(logging.INFO if restored.miss.value == "missing" else logging.WARNING, "chunk %s not restored (%s): %s",
                key[-16:], restored.miss.value, restored.detail)
    return restored.ok
