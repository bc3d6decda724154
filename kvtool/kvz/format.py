"""The ``.kvz`` format's fixed parts: magic, records, bounds, and the errors a reader raises.

Layout of a file (all integers little-endian; docs/FORMAT.md is the reference)::

    preamble   magic (8) | version u32 | header length u32
    header     JSON: recipe, tensor manifest, model facts, provenance, metadata
    chunks     one per (tensor, token block, plane), back to back
    index      one 56-byte record per chunk
    trailer    64 bytes: index offset and length, chunk count, header length,
               xxh3-64 of header, index and trailer; end magic
"""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np
import xxhash

from kvtool.errors import DecodeError, OutputTooLargeError

MAGIC = b"\x89KVZ\r\n\x1a\n"
END_MAGIC = b"KVZ-END\n"
VERSION = 1
PREAMBLE = struct.Struct("<8sII")
TRAILER = struct.Struct("<QQQQQQQ8s")
MAX_HEADER = 16 << 20
MAX_CHUNK_TOKENS = 1 << 20
DEFAULT_CHUNK_TOKENS = 256
FLAG_STORED_RAW = 1
#: Bounds a reader checks before it computes with a header's numbers.
MAX_TOKENS = (1 << 32) - 1  # an index record holds token positions as u32
MAX_TOKEN_START = (1 << 63) - 1
MAX_ROW_BYTES = 1 << 30  # heads x head_dim x itemsize of one token of one tensor
MAX_JSON_DEPTH = 32
#: What a reader decodes at most unless told otherwise (``max_size``; CLI ``--max-size``).
DEFAULT_MAX_SIZE = 16 << 30
#: How many times its stored bytes a token block (all its planes) may decode to unless told
#: otherwise (``max_expansion``; CLI ``--max-expansion``). Blocks of real caches stay below 7,
#: lossy recipes included (BENCHMARKS.md, "Bounded readers"); zstd alone reaches about
#: 32,000 on zeros, so without this bound a 66 KB file could make a reader allocate 2 GiB.
DEFAULT_MAX_EXPANSION = 1024

INDEX_DTYPE = np.dtype(
    [
        ("tensor", "<u4"),  # position in the header's tensor manifest
        ("plane", "<u2"),  # position in the recipe's plane list
        ("flags", "<u2"),  # FLAG_STORED_RAW: bytes stored without the codec
        ("token_start", "<u4"),
        ("token_count", "<u4"),
        ("offset", "<u8"),  # from the start of the file
        ("stored_len", "<u8"),
        ("raw_len", "<u8"),
        ("stored_xxh3", "<u8"),  # of the bytes as stored
        ("raw_xxh3", "<u8"),  # of the plane's bytes before compression
    ]
)
assert INDEX_DTYPE.itemsize == 56


def trailer_hash(fields: Sequence[int]) -> int:
    """The trailer's own checksum, over its six numbers."""
    return xxhash.xxh3_64_intdigest(struct.pack("<6Q", *fields))


class KvzError(DecodeError):
    """A .kvz that cannot be read, with where and why as data.

    ``cause`` is one of ``"format"`` (not this format, or a header that breaks its rules),
    ``"damaged"`` (a checksum mismatch, a truncation, sizes that do not add up, a chunk
    that does not decode or does not fit its destination) and ``"too_large"`` (over the
    caller's ``max_size`` or ``max_expansion``). ``chunk`` (its index record), ``layer`` and
    ``kind`` (``"k"`` or ``"v"``) are set where one chunk is at fault.
    """

    cause = "damaged"

    def __init__(self, message: str, *, chunk: int | None = None, layer: int | None = None, kind: str | None = None):
        super().__init__(message)
        self.chunk = chunk
        self.layer = layer
        self.kind = kind


class KvzFormatError(KvzError):
    """Not a .kvz file, an unsupported version, or a header that breaks the format's rules."""

    cause = "format"


class KvzCorruptError(KvzError):
    """A checksum mismatch, a truncation, or sizes that do not add up."""

    cause = "damaged"


class KvzTooLargeError(KvzError, OutputTooLargeError):
    """Decoding would exceed the caller's ``max_size`` or a chunk its ``max_expansion``."""

    cause = "too_large"
