"""The ``.kvz`` format: a KV cache cut into checksummed, compressed chunks (docs/FORMAT.md).

``format`` holds the constants, records and errors; ``header`` the frozen header
value, parsed and validated once on open; ``pipeline`` how chunks decode into a
destination, chosen once per reader; ``reader`` and ``writer`` the two ends. A
writer streams (header first, index last); a reader seeks to the trailer, checks
every size before it allocates, and reads only the chunks it needs.
"""

from __future__ import annotations

from kvtool.kvz.format import (
    DEFAULT_CHUNK_TOKENS, DEFAULT_MAX_EXPANSION, DEFAULT_MAX_SIZE, MAGIC, KvzCorruptError, KvzError, KvzFormatError,
    KvzTooLargeError,
)
from kvtool.kvz.reader import KvzReader, decode_cache, is_kvz, open_kvz
from kvtool.kvz.writer import encode_cache, save, write_cache

__all__ = [
    "DEFAULT_CHUNK_TOKENS", "DEFAULT_MAX_EXPANSION", "DEFAULT_MAX_SIZE", "MAGIC", "KvzCorruptError", "KvzError",
    "KvzFormatError", "KvzReader", "KvzTooLargeError", "decode_cache", "encode_cache", "is_kvz", "open_kvz", "save",
    "write_cache",
]
