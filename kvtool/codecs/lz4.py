"""LZ4 frame format, through the ``lz4`` package.

Frames carry the content size and a content checksum; decode stops at
``max_size`` bytes instead of trusting the header, and takes its output in
steps, so a generous ``max_size`` reserves no memory up front.
"""

from __future__ import annotations

import lz4
import lz4.frame

from kvtool.codecs.base import Availability, BufferLike, Codec, as_memoryview, check_output_size
from kvtool.errors import DecodeError, UsageError


class Lz4Codec(Codec):
    codec_id = "lz4"
    params = ("level",)
    magic = b"\x04\x22\x4d\x18"

    def __init__(self, level: int = 0):
        if not 0 <= int(level) <= lz4.frame.COMPRESSIONLEVEL_MAX:
            raise UsageError(f"lz4 level must be in 0..{lz4.frame.COMPRESSIONLEVEL_MAX}, not {level}")
        self.level = int(level)

    @classmethod
    def available(cls) -> Availability:
        return Availability(True, implementation=f"liblz4 {lz4.library_version_string()}")

    def encode(self, buf: BufferLike) -> bytes:
        view = as_memoryview(buf)
        return lz4.frame.compress(
            view, compression_level=self.level, content_checksum=True, store_size=True, return_bytearray=False
        )

    def decode(self, buf: BufferLike, max_size: int) -> bytes:
        dec = lz4.frame.LZ4FrameDecompressor()
        parts, size, data = [], 0, as_memoryview(buf)
        try:
            while not dec.eof:
                part = dec.decompress(data, max_length=min(max_size - size + 1, _STEP))
                data = memoryview(b"")  # the decoder keeps what it has not consumed yet
                parts.append(part)
                size += len(part)
                check_output_size(size, max_size)
                if not part and not dec.eof:
                    raise DecodeError("truncated lz4 frame")
            if dec.unused_data:
                raise DecodeError(f"{len(dec.unused_data)} bytes of trailing data after the lz4 frame")
        except RuntimeError as exc:  # the lz4 package reports corrupt frames as RuntimeError
            raise DecodeError(f"corrupt lz4 data: {exc}") from None
        return b"".join(parts)


#: Output taken from the decoder per call: large enough to be fast, small enough to reserve little.
_STEP = 16 << 20
