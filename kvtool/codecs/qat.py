"""Gzip through Intel QAT, via the QATzip library (hardware, or its software fallback).

The wire format is gzip: QATzip writes gzip members with an extra header field
(its ``QZ_DEFLATE_GZIP_EXT`` format) that every gzip decoder skips. Encoding
needs libqatzip; decoding does not: any gzip stream, from QATzip or any other
tool, single or multi-member, decodes with Python's zlib under the output cap.
Decoding through ``qzDecompress`` was measured and dropped: in software it runs
the same zlib inflate at the same speed, but needs the whole output buffer up
front, reports an oversized result as corrupt data, and accepts truncated input.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any

from kvtool.codecs import _qatzip
from kvtool.codecs.base import Availability, BufferLike, Codec, as_memoryview
from kvtool.codecs.zlib import inflate
from kvtool.errors import UnavailableError, UsageError


class QatCodec(Codec):
    codec_id = "qat"
    params = ("level", "hw_buffer_size")
    magic = b"\x1f\x8b"

    def __init__(self, level: int = 1, hw_buffer_size: int = _qatzip.DEFAULT_HW_BUFFER_SIZE):
        if not 1 <= int(level) <= 9:
            raise UsageError(f"qat level must be in 1..9, not {level}")
        size = int(hw_buffer_size)
        if not _qatzip.MIN_HW_BUFFER_SIZE <= size <= _qatzip.MAX_HW_BUFFER_SIZE or size & (size - 1):
            raise UsageError(
                f"qat hw_buffer_size must be a power of two from {_qatzip.MIN_HW_BUFFER_SIZE} "
                f"to {_qatzip.MAX_HW_BUFFER_SIZE} bytes, not {hw_buffer_size}"
            )
        self.level = int(level)
        self.hw_buffer_size = size

    @classmethod
    def available(cls) -> Availability:
        try:
            lib = _qatzip.load()
        except UnavailableError as exc:
            return Availability(False, reason=str(exc))
        return Availability(True, implementation=lib.implementation)

    @classmethod
    def details(cls) -> dict[str, Any]:
        """Which libqatzip encodes here, and whether it drives a QAT device."""
        try:
            lib = _qatzip.load()
        except UnavailableError:
            return {"library": None, "library_version": None, "hardware": False}
        return {
            "library": lib.path,
            "library_version": lib.version,
            "hardware": lib.hardware,
            "session_status": lib.session_status,
        }

    def encode(self, buf: BufferLike) -> bytes:
        try:
            lib = _qatzip.load()
        except UnavailableError as exc:
            raise UnavailableError(f"codec 'qat' cannot encode: {exc}") from None
        if lib.budget_spent:
            return _software_gzip(as_memoryview(buf), self.level)
        return lib.compress(as_memoryview(buf), self.level, self.hw_buffer_size)

    def decode(self, buf: BufferLike, max_size: int) -> bytes:
        return inflate(as_memoryview(buf), max_size, wbits=31, name="gzip", multi_member=True)


def _software_gzip(view: memoryview, level: int) -> bytes:
    """What QATzip's software fallback computes (zlib deflate in gzip), without calling QATzip.

    Used only when no QAT device is present and this process has spent
    ``_qatzip.SOFTWARE_CALL_BUDGET`` calls: libqatzip 1.3 leaks a thread key per
    software call. The stream is the same format, so any reader is unaffected.
    """
    global _budget_logged
    if not _budget_logged:
        _budget_logged = True
        logging.getLogger("kvtool.codecs").warning(
            "qat: no QAT device and libqatzip leaks a thread key per software call; after %d calls "
            "this process writes the same gzip format with zlib, as QATzip's software fallback does",
            _qatzip.SOFTWARE_CALL_BUDGET,
        )
    compressor = zlib.compressobj(level, zlib.DEFLATED, 31)
    return compressor.compress(view) + compressor.flush()


_budget_logged = False
