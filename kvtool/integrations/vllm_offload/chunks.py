"""One offload row to a store entry and back: encode with a recipe, decode straight into the row.

``save_row`` reads the row where vLLM keeps it (the tier pins it until the job is
reported), cuts it into ``[kv_heads, tokens, head_dim]`` arrays (``RowLayout``),
encodes them as one ``.kvz`` with the recipe and stores the result. ``load_row``
fetches an entry (the store verifies its checksum), checks that it holds exactly
the arrays a row of this layout holds, and decodes its chunks into the row's own
bytes with ``KvzReader.read_rows``: no intermediate cache. Every failure (missing,
damaged, another shape, a store that is down) is ``False``, a miss, with the
reason logged.
"""

from __future__ import annotations

import logging

import numpy as np

from kvtool.cache import KVCache
from kvtool.kvz import KvzReader, encode_cache
from kvtool.errors import KvtoolError
from kvtool.integrations.vllm_offload.rows import RowLayout
from kvtool.store import Store

log = logging.getLogger("kvtool.vllm.tier")


def row_cache(region: np.ndarray, row: int, layout: RowLayout) -> KVCache:
    """The KV arrays of chunk ``row`` of the region (``[rows, row_stride]`` bytes), as views where the cut allows."""
    flat = region[row, :layout.used_bytes].view(layout.dtype.numpy)
    pairs = layout.split(flat)
    return KVCache([k for k, _ in pairs], [v for _, v in pairs], provenance={"source": "vllm-offload"})


def check_recipe(layout: RowLayout, recipe: str) -> None:
    """Encode one block of zeros shaped as this layout's arrays: a recipe that cannot code them fails at startup."""
    heads, _, dim = layout.array_shape
    zeros = np.zeros((heads, layout.block_tokens, dim), layout.dtype.numpy)
    encode_cache(KVCache([zeros], [zeros]), recipe, chunk_tokens=layout.block_tokens, threads=1)


def save_row(store: Store, key: str, region: np.ndarray, row: int, layout: RowLayout, recipe: str) -> bool:
    """Encode chunk ``row`` with ``recipe`` and store it under ``key``; False if it was not stored."""
    try:
        cache = row_cache(region, row, layout)
        blob = encode_cache(cache, recipe, chunk_tokens=max(1, layout.tokens), threads=1)
        return store.put(key, blob, {"tokens": layout.tokens, "raw_bytes": layout.used_bytes})
    except KvtoolError as exc:
        log.warning("chunk %s not stored: %s", key[-16:], exc)
        return False


def load_row(store: Store, key: str, region: np.ndarray, row: int, layout: RowLayout, offsets: np.ndarray) -> bool:
    """Decode the entry under ``key`` into chunk ``row`` of the region; False (a miss) if it cannot be.

    ``offsets`` is ``layout.row_offsets()``, computed once.
    """
    try:
        entry = store.get_entry(key)
        if entry is None:
            log.info("chunk %s: missing or damaged in %s", key[-16:], store.describe())
            return False
        with KvzReader.from_bytes(entry.value, max_size=layout.used_bytes) as reader:
            shape = layout.array_shape
            fits = (
                reader.dtype == layout.dtype
                and reader.layer_ids == list(range(layout.num_arrays))
                and all(tuple(s) == shape for _, _, s in reader.tensors)
            )
            if not fits:
                log.warning("chunk %s does not hold a row of this layout; treated as a miss", key[-16:])
                return False
            reader.read_rows([region.reshape(-1)], offsets + row * layout.row_stride, [0] * offsets.shape[0])
        return True
    except KvtoolError as exc:
        log.warning("chunk %s not restored: %s", key[-16:], exc)
        return False
