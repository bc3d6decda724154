"""The ``.kvd`` file around a dictionary's payload: magic, version, lengths, the payload deflated.

Both kinds of model dictionary share it; the version says which payload follows:
1, the context models of ``ctxans`` and ``ctxtans`` (``kvtool.modeldict.format``); 2, the
transform bases of the ``pca`` stage (``kvtool.modeldict.basis``). A dictionary's id is
the first 16 bytes of the SHA-256 of its payload, as 32 hex digits, whatever its kind.

File (little-endian)::

    magic        8 bytes  b"\\x89KVD\\r\\n\\x1a\\n"
    version      u32      1 or 2
    payload len  u32      bytes of the payload, at most the version's limit
    stored len   u32      bytes of the zlib stream that follows
    zlib stream  the payload, deflated
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

from kvtool.errors import DecodeError

if TYPE_CHECKING:
    from typing_extensions import Self

MAGIC = b"\x89KVD\r\n\x1a\n"
FILE_HEAD = struct.Struct("<8sIII")
#: The largest payload of each version: context models are small, a model's bases are not.
MAX_PAYLOAD = {1: 1 << 22, 2: 1 << 26}
#: The largest metadata section (JSON: what a dictionary was learnt from).
MAX_META = 1 << 16
#: The largest ``.kvd`` file of any version (a payload deflates to about its own size at worst).
MAX_FILE = FILE_HEAD.size + (MAX_PAYLOAD[2] + (MAX_PAYLOAD[2] >> 8) + 64)


class DictionaryError(DecodeError):
    """Bytes that are not a valid .kvd dictionary."""


class KvdFile:
    """What both kinds of dictionary share: the id and tag their payload gives them, and the ``.kvd`` file around it.
    A kind sets ``version`` and defines ``payload`` and ``from_payload``."""

    version: ClassVar[int]

    @property
    def payload(self) -> bytes:
        raise NotImplementedError

    @classmethod
    def from_payload(cls, payload: bytes) -> "Self":
        raise NotImplementedError

    @cached_property
    def id(self) -> str:
        return payload_id(self.payload)

    @property
    def tag(self) -> bytes:
        """The 4 bytes of the id every block or chunk coded with this dictionary carries."""
        return bytes.fromhex(self.id[:8])

    def to_bytes(self) -> bytes:
        return pack(self.version, self.payload)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "Self":
        return cls.from_payload(unpack(data, cls.version))


def payload_id(payload: bytes) -> str:
    """A dictionary's id: the first 16 bytes of the SHA-256 of its payload, in hex."""
    return hashlib.sha256(payload).hexdigest()[:32]


def pack(version: int, payload: bytes) -> bytes:
    """The ``.kvd`` file of ``payload``."""
    stored = zlib.compress(payload, 9)
    return FILE_HEAD.pack(MAGIC, version, len(payload), len(stored)) + stored


def version_of(data: bytes | bytearray | memoryview) -> int:
    """The version of a ``.kvd`` file, read from its head alone (``DictionaryError`` if it is not one)."""
    if len(data) < FILE_HEAD.size:
        raise DictionaryError("not a .kvd dictionary (too short)")
    magic, version, _, _ = FILE_HEAD.unpack_from(data)
    version = int(version)
    if magic != MAGIC:
        raise DictionaryError("not a .kvd dictionary (bad magic)")
    if version not in MAX_PAYLOAD:
        raise DictionaryError(f".kvd version {version} is not supported (this kvtool reads versions 1 and 2)")
    return version


def unpack(data: bytes | bytearray | memoryview, version: int) -> bytes:
    """The payload of a ``.kvd`` file of ``version``, inflated no further than its limit."""
    if version_of(data) != version:
        raise DictionaryError(f"a .kvd dictionary of version {version_of(data)}, not {version}")
    _, _, payload_len, stored_len = FILE_HEAD.unpack_from(data)
    if payload_len > MAX_PAYLOAD[version] or stored_len != len(data) - FILE_HEAD.size:
        raise DictionaryError("a .kvd dictionary's lengths do not match its size")
    inflater = zlib.decompressobj()
    try:
        payload = inflater.decompress(bytes(data[FILE_HEAD.size :]), payload_len + 1)
    except zlib.error as exc:
        raise DictionaryError(f"a .kvd dictionary's payload does not inflate ({exc})") from None
    if len(payload) != payload_len or not inflater.eof or inflater.unused_data:
        raise DictionaryError("a .kvd dictionary's payload has the wrong length")
    return payload


def meta_section(meta: dict[str, Any]) -> bytes:
    """A payload's first section: the metadata as canonical JSON (keys sorted, no spaces), after its u32 length."""
    data = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    return struct.pack("<I", len(data)) + data


def read_meta(payload: bytes) -> tuple[dict[str, Any], int]:
    """A payload's metadata and the offset of what follows it; ``DictionaryError`` unless it is a JSON object."""
    try:
        (length,) = struct.unpack_from("<I", payload)
        if length > MAX_META:
            raise DictionaryError("a .kvd dictionary's metadata is too long")
        meta = json.loads(payload[4 : 4 + length])
    except (struct.error, ValueError) as exc:  # json errors are ValueErrors
        raise DictionaryError(f"malformed .kvd dictionary ({exc})") from None
    if not isinstance(meta, dict):
        raise DictionaryError("a .kvd dictionary's metadata must be a JSON object")
    return meta, 4 + length
