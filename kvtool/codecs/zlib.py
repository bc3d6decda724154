"""Deflate in the zlib wrapper (RFC 1950), through Python's zlib module."""

from __future__ import annotations

import zlib
from types import ModuleType

from kvtool.codecs.base import Availability, BufferLike, Codec, as_memoryview, check_output_size
from kvtool.errors import DecodeError, UsageError


class ZlibCodec(Codec):
    codec_id = "zlib"
    params = ("level",)

    def __init__(self, level: int = 6):
        if not 0 <= int(level) <= 9:
            raise UsageError(f"zlib level must be in 0..9, not {level}")
        self.level = int(level)

    @classmethod
    def available(cls) -> Availability:
        return Availability(True, implementation=f"zlib {zlib.ZLIB_RUNTIME_VERSION}")

    def encode(self, buf: BufferLike) -> bytes:
        return zlib.compress(as_memoryview(buf), self.level)

    def decode(self, buf: BufferLike, max_size: int) -> bytes:
        return inflate(as_memoryview(buf), max_size, wbits=15, name="zlib")


def inflate(
    view: memoryview, max_size: int, wbits: int, name: str, multi_member: bool = False, backend: ModuleType = zlib
) -> bytes:
    """Inflate ``view`` with at most ``max_size`` bytes of output.

    ``wbits`` picks the wrapper (15 zlib, 31 gzip). ``multi_member`` accepts
    concatenated gzip members, as ``gzip -d`` does and as QATzip writes.
    ``backend`` is a module with zlib's ``decompressobj`` and ``error``
    (``zlib`` or ISA-L's ``isal.isal_zlib``).
    """
    out = bytearray()
    data: bytes | memoryview = view
    try:
        while True:
            dobj = backend.decompressobj(wbits)
            out += dobj.decompress(data, max_size - len(out) + 1)
            check_output_size(len(out), max_size)
            if not dobj.eof:
                raise DecodeError(f"truncated {name} data")
            data = dobj.unused_data
            if not data:
                return bytes(out)
            if not multi_member:
                raise DecodeError(f"{len(data)} bytes of trailing data after the {name} stream")
    except backend.error as exc:
        raise DecodeError(f"corrupt {name} data: {exc}") from None
