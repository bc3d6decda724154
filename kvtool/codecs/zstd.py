"""Zstandard, through the ``zstandard`` package (libzstd).

Frames are written with their content size and a checksum, so decode can refuse
an oversized frame before allocating and detects corruption.
"""

from __future__ import annotations

import threading

import zstandard

from kvtool.codecs.base import Availability, BufferLike, Codec, as_memoryview, check_output_size
from kvtool.errors import DecodeError, UsageError


class ZstdCodec(Codec):
    codec_id = "zstd"
    params = ("level", "threads")
    magic = b"\x28\xb5\x2f\xfd"

    def __init__(self, level: int = 3, threads: int = 0):
        lo, hi = -(1 << 17), zstandard.MAX_COMPRESSION_LEVEL
        if not lo <= int(level) <= hi:
            raise UsageError(f"zstd level must be in {lo}..{hi}, not {level}")
        if int(threads) < 0:
            raise UsageError(f"zstd threads must be >= 0, not {threads}")
        self.level = int(level)
        self.threads = int(threads)
        self._local = threading.local()  # zstd contexts are not thread-safe

    @classmethod
    def available(cls) -> Availability:
        return Availability(True, implementation=f"libzstd {zstandard.ZSTD_VERSION[0]}.{zstandard.ZSTD_VERSION[1]}.{zstandard.ZSTD_VERSION[2]} ({zstandard.backend})")

    def _cctx(self) -> zstandard.ZstdCompressor:
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = self._local.cctx = zstandard.ZstdCompressor(
                level=self.level, threads=self.threads, write_checksum=True, write_content_size=True
            )
        return cctx

    def _dctx(self) -> zstandard.ZstdDecompressor:
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        return dctx

    def encode(self, buf: BufferLike) -> bytes:
        return self._cctx().compress(as_memoryview(buf))

    def decode(self, buf: BufferLike, max_size: int) -> bytes:
        view = as_memoryview(buf)
        try:
            size = zstandard.frame_content_size(view)
        except zstandard.ZstdError as exc:
            raise DecodeError(f"not a zstd frame: {exc}") from None
        try:
            if size >= 0:
                check_output_size(size, max_size)
                return self._dctx().decompress(view, allow_extra_data=False)
            # Unknown content size (a stream from another tool): libzstd caps the output.
            return self._dctx().decompress(view, max_output_size=max_size, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise DecodeError(f"corrupt zstd data (or larger than {max_size} bytes): {exc}") from None
