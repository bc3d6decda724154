"""One chunk to a .kvz value and back into its destination: the adapter's only use of the container.

Encoding takes the object's bytes as views (``ChunkLayout.cache``); decoding
checks that the stored cache is exactly the destination's layout, then writes
every row straight into the destination's bytes (``read_rows``: with the native
core one pass per stored chunk, each chunk's checksums verified first).
"""

from __future__ import annotations

import numpy as np

from kvtool.kvz import KvzReader, encode_cache
from kvtool.kvz.format import MAX_CHUNK_TOKENS
from kvtool.errors import KvtoolError
from kvtool.integrations.lmcache.chunks import ChunkLayout


class LayoutMismatch(KvtoolError):
    """A stored entry that does not have the destination's layout (another model, chunk size or dtype)."""


def encode_chunk(data: np.ndarray, layout: ChunkLayout, recipe: str, model: str) -> bytes:
    """The .kvz bytes of one object (a flat uint8 view of it) coded with ``recipe``."""
    cache = layout.cache(data, model)
    return encode_cache(cache, recipe, chunk_tokens=max(1, min(layout.tokens, MAX_CHUNK_TOKENS)), threads=1)


def decode_chunk_into(value: memoryview, layout: ChunkLayout, out: np.ndarray) -> None:
    """Decode a stored .kvz into ``out`` (the destination's flat uint8 bytes); raises a ``KvtoolError`` on any fault."""
    with KvzReader.from_bytes(value, max_size=layout.nbytes) as reader:
        if not layout.matches(reader.layer_ids, reader.dtype.name, [shape for _, _, shape in reader.tensors]):
            raise LayoutMismatch("the stored chunk has another layout than the destination")
        reader.read_rows([out], layout.rows(), [0] * (2 * layout.layers))
