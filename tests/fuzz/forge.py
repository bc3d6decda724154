"""Take a .kvz apart into its structured parts and put parts back together, with valid checksums.

A forged file passes the container's outer checks (magic, lengths, header,
index and trailer checksums) unless a test asks otherwise, so that what a
reader makes of the *content* of the header, the index and the chunks is what
is tested. ``Raw("1e400")`` in a header is written into the JSON verbatim.
"""

from __future__ import annotations

import copy
import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvtool.kvz.format import END_MAGIC, INDEX_DTYPE, MAGIC, PREAMBLE, TRAILER, VERSION


@dataclass(frozen=True)
class Raw:
    """JSON text to put into a header as it is: ``1e400``, ``NaN``, ``[[[[...]]]]``."""

    text: str


@dataclass
class Parts:
    header: Any  # a JSON-able value, possibly holding Raw(...)
    index: np.ndarray  # INDEX_DTYPE records, one per chunk
    chunks: list[bytes]
    version: int = VERSION
    trailer: dict[str, int] = field(default_factory=dict)  # overrides of computed trailer fields

    def copy(self) -> "Parts":
        return Parts(copy.deepcopy(self.header), self.index.copy(), list(self.chunks), self.version, dict(self.trailer))


def dissect(blob: bytes) -> Parts:
    """The parts of a valid .kvz."""
    _, version, header_len = PREAMBLE.unpack_from(blob)
    header = json.loads(blob[PREAMBLE.size : PREAMBLE.size + header_len])
    index_offset, index_len, *_ = TRAILER.unpack_from(blob, len(blob) - TRAILER.size)
    index = np.frombuffer(blob[index_offset : index_offset + index_len], dtype=INDEX_DTYPE).copy()
    chunks = [blob[int(e["offset"]) : int(e["offset"]) + int(e["stored_len"])] for e in index]
    return Parts(header, index, chunks, version)


def header_bytes(header: Any) -> bytes:
    """The header as compact JSON, with every ``Raw`` value spliced in verbatim."""
    raws: list[str] = []

    def swap(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"\0raw{len(raws) - 1}\0"
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        return value

    text = json.dumps(swap(header), separators=(",", ":"), sort_keys=True)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\0raw{i}\0"), raw)
    return text.encode()


def assemble(parts: Parts, *, tile: bool = True, stored_hashes: bool = True) -> bytes:
    """A .kvz from ``parts`` with valid header, index and trailer checksums.

    ``tile`` rewrites each record's offset and stored length to where its chunk
    lands; ``stored_hashes`` rewrites each stored checksum to match its chunk
    (raw checksums are kept, so a chunk that decodes to other bytes is still caught).
    """
    header = header_bytes(parts.header)
    index = parts.index.copy()
    offset = PREAMBLE.size + len(header)
    for row, chunk in enumerate(parts.chunks):
        if tile and row < len(index):
            index[row]["offset"], index[row]["stored_len"] = offset, len(chunk)
        if stored_hashes and row < len(index):
            index[row]["stored_xxh3"] = xxhash.xxh3_64_intdigest(chunk)
        offset += len(chunk)
    index_bytes = index.tobytes()
    fields = {
        "index_offset": offset,
        "index_len": len(index_bytes),
        "chunks": len(index),
        "header_len": len(header),
        "header_hash": xxhash.xxh3_64_intdigest(header),
        "index_hash": xxhash.xxh3_64_intdigest(index_bytes),
    }
    fields.update(parts.trailer)
    values = list(fields.values())
    trailer_hash = xxhash.xxh3_64_intdigest(struct.pack("<6Q", *values))
    return b"".join(
        [PREAMBLE.pack(MAGIC, parts.version, len(header)), header, *parts.chunks, index_bytes,
         TRAILER.pack(*values, trailer_hash, END_MAGIC)]
    )
