"""The record every store keeps: a value wrapped with its key, metadata and checksum.

A store checks integrity itself, whatever the value is, so a value that was cut
short, bit-flipped, or written under another key becomes a miss instead of
wrong bytes. All integers are little-endian::

    offset 0   magic        4 bytes  b"KVSE"
    offset 4   version      u8       1
    offset 5   key length   u16      K, 1..1024
    offset 7   meta length  u32      M, at most 64 KiB
    offset 11  value length u64      V
    offset 19  checksum     u64      XXH3-64 (seed 0) of bytes 0-18, key, meta and value
    offset 27  key          K bytes of UTF-8
    offset 27+K meta        M bytes of UTF-8 JSON (an object)
    offset 27+K+M value     V bytes

The record's length must be exactly ``27 + K + M + V``. The key inside the
record is compared with the key asked for, so a record moved under another key
is refused. Metadata conventions: ``tokens`` (how many tokens of KV cache the
value holds) and ``raw_bytes`` (the uncompressed size of that cache).
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

import xxhash

from kvtool.errors import DecodeError, UsageError

MAGIC = b"KVSE"
VERSION = 1
HEADER = struct.Struct("<4sBHIQQ")
MAX_KEY_BYTES = 1024
MAX_META_BYTES = 64 * 1024


class CorruptEntryError(DecodeError):
    """A stored record that fails its checks; stores turn it into a miss."""


@dataclass(frozen=True)
class EntryInfo:
    """What is known about a stored entry without reading its value."""

    key: str
    size: int  # bytes of the whole record as stored
    meta: dict[str, Any]

    @property
    def tokens(self) -> int | None:
        tokens = self.meta.get("tokens")
        return tokens if isinstance(tokens, int) and tokens >= 0 else None

    @property
    def raw_bytes(self) -> int | None:
        raw = self.meta.get("raw_bytes")
        return raw if isinstance(raw, int) and raw >= 0 else None


@dataclass(frozen=True)
class Entry(EntryInfo):
    """A verified record; ``value`` is a read-only view into it (``bytes(value)`` copies)."""

    record: bytes
    value_offset: int

    @property
    def value(self) -> memoryview:
        return memoryview(self.record)[self.value_offset:]


def check_key(key: str) -> bytes:
    """The UTF-8 bytes of a valid key; a key is 1..1024 bytes of Unicode text with no control characters.

    A lone surrogate (``"\\ud800"``, what ``os.fsdecode`` makes of undecodable
    bytes) is not text: it has no UTF-8 form that other processes and Redis would
    read back as the same key, so it is refused.
    """
    if not isinstance(key, str):
        raise UsageError(f"a store key is a string, not {type(key).__name__}")
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(
            f"invalid store key {key[:80]!r}: lone surrogate {key[exc.start]!r} at position {exc.start} "
            "is not Unicode text"
        ) from None
    if not 0 < len(raw) <= MAX_KEY_BYTES or any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise UsageError(f"invalid store key {key[:80]!r}: 1 to {MAX_KEY_BYTES} bytes, no control characters")
    return raw


def _meta_bytes(meta: dict[str, Any]) -> bytes:
    try:
        meta_raw = json.dumps(meta, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise UsageError(f"entry metadata must be JSON-safe: {exc}") from exc
    if len(meta_raw) > MAX_META_BYTES:
        raise UsageError(f"entry metadata is {len(meta_raw)} bytes; the limit is {MAX_META_BYTES}")
    return meta_raw


def wrap_written(key: str, meta: dict[str, Any], write_value: Callable[[BinaryIO], object]) -> Entry:
    """Build the record of the value ``write_value(out)`` writes, in one buffer: the value is never copied.

    For a value made by a writer (a .kvz), where ``wrap`` would join a copy of it onto its header.
    """
    key_raw = check_key(key)
    meta = dict(meta)
    meta_raw = _meta_bytes(meta)
    offset = HEADER.size + len(key_raw) + len(meta_raw)
    out = io.BytesIO()
    out.write(bytes(offset))
    write_value(out)
    size = out.tell()
    with out.getbuffer() as view:
        head = HEADER.pack(MAGIC, VERSION, len(key_raw), len(meta_raw), size - offset, 0)[:-8]
        digest = xxhash.xxh3_64(head)
        digest.update(key_raw)
        digest.update(meta_raw)
        digest.update(view[offset:])
    out.seek(0)
    out.write(b"".join((head, digest.intdigest().to_bytes(8, "little"), key_raw, meta_raw)))
    return Entry(key, size, meta, out.getvalue(), offset)  # getvalue hands over the buffer itself, not a copy


def wrap(key: str, value: bytes | bytearray | memoryview, meta: dict[str, Any] | None = None) -> Entry:
    """Build the record for ``value`` stored under ``key``."""
    key_raw = check_key(key)
    meta = dict(meta or {})
    meta_raw = _meta_bytes(meta)
    try:
        value = memoryview(value).cast("B")
    except TypeError as exc:
        raise UsageError(f"a store value must be a contiguous bytes-like object ({exc})") from None
    head = HEADER.pack(MAGIC, VERSION, len(key_raw), len(meta_raw), value.nbytes, 0)[:-8]
    digest = xxhash.xxh3_64()
    for part in (head, key_raw, meta_raw, value):
        digest.update(part)
    record = b"".join((head, digest.intdigest().to_bytes(8, "little"), key_raw, meta_raw, value))
    offset = HEADER.size + len(key_raw) + len(meta_raw)
    return Entry(key, len(record), meta, record, offset)


def parse_head(head: bytes, record_size: int) -> tuple[int, int, int]:
    """Check a record's fixed header against its total size: ``(key_len, meta_len, checksum)``."""
    if len(head) < HEADER.size:
        raise CorruptEntryError(f"truncated: {record_size} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, key_len, meta_len, value_len, checksum = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise CorruptEntryError(f"bad magic {magic!r}")
    if version != VERSION:
        raise CorruptEntryError(f"unsupported entry version {version}")
    if not 0 < key_len <= MAX_KEY_BYTES or meta_len > MAX_META_BYTES:
        raise CorruptEntryError(f"implausible key or metadata length ({key_len}, {meta_len})")
    expected = HEADER.size + key_len + meta_len + value_len
    if expected != record_size:
        raise CorruptEntryError(f"length mismatch: header says {expected} bytes, record has {record_size}")
    return key_len, meta_len, checksum


def parse_info(prefix: bytes, record_size: int) -> EntryInfo:
    """Key and metadata from the first bytes of a record (checksum not verified)."""
    key_len, meta_len, _ = parse_head(prefix, record_size)
    end = HEADER.size + key_len + meta_len
    if len(prefix) < end:
        raise CorruptEntryError("truncated before the end of the metadata")
    try:
        key = bytes(prefix[HEADER.size:HEADER.size + key_len]).decode("utf-8")
        meta = json.loads(bytes(prefix[HEADER.size + key_len:end]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptEntryError(f"unreadable key or metadata: {exc}") from exc
    if not isinstance(meta, dict):
        raise CorruptEntryError("metadata is not a JSON object")
    return EntryInfo(key, record_size, meta)


def unwrap(record: bytes, expected_key: str | None = None, check_value: bool = True) -> Entry:
    """Verify a record fully; raises ``CorruptEntryError`` saying what is wrong.

    Without ``check_value`` the header, key and metadata are parsed and checked but no byte is hashed: for a
    caller that verifies the value itself, as a .kvz reader checks every chunk it reads, so a restore hashes
    each byte once. Metadata read that way is unverified; such a caller must not act on it.
    """
    record = bytes(record)
    key_len, meta_len, checksum = parse_head(record, len(record))
    if check_value:
        digest = xxhash.xxh3_64()
        view = memoryview(record)
        digest.update(view[:HEADER.size - 8])
        digest.update(view[HEADER.size:])
        if digest.intdigest() != checksum:
            raise CorruptEntryError("checksum mismatch")
    info = parse_info(record, len(record))
    if expected_key is not None and info.key != expected_key:
        raise CorruptEntryError(f"record belongs to another key ({info.key[:80]!r})")
    return Entry(info.key, info.size, info.meta, record, HEADER.size + key_len + meta_len)
