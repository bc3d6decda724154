"""Gzip through Intel QATzip, forced (``qat``): a QAT device, or QATzip's software fallback.

The format is gzip: this codec writes ``gzip`` configs (``kvtool.codecs.gzip``
picks QATzip by itself when a QAT device is present), and its id stays to read
files written before ``gzip`` existed and to force QATzip in benchmarks.
QATzip writes gzip members with an extra header field (its
``QZ_DEFLATE_GZIP_EXT`` format) that every gzip decoder skips. Encoding needs
libqatzip; decoding does not: any gzip stream, from QATzip or any other tool,
single or multi-member, decodes with Python's zlib under the output cap.
Decoding through ``qzDecompress`` was measured and dropped: in software it runs
the same zlib inflate at the same speed, but needs the whole output buffer up
front, reports an oversized result as corrupt data, and accepts truncated input.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from kvtool.codecs import _qatzip, _qatzip_abi, _qatzip_fallback
from kvtool.codecs.base import Availability, BufferLike, as_memoryview
from kvtool.codecs.gzip import GzipCodec, _zlib_compress
from kvtool.errors import UnavailableError, UsageError


class QatCodec(GzipCodec):
    codec_id: ClassVar[str] = "qat"
    # Read from configs (files written as "qat"); written configs hold only the gzip level.
    params: ClassVar[tuple[str, ...]] = ("level", "hw_buffer_size")
    levels: ClassVar[tuple[int, int]] = (1, 9)

    def __init__(self, level: int = 1, hw_buffer_size: int = _qatzip_abi.DEFAULT_HW_BUFFER_SIZE):
        super().__init__(level)
        size = int(hw_buffer_size)
        if not _qatzip_abi.MIN_HW_BUFFER_SIZE <= size <= _qatzip_abi.MAX_HW_BUFFER_SIZE or size & (size - 1):
            raise UsageError(
                f"qat hw_buffer_size must be a power of two from {_qatzip_abi.MIN_HW_BUFFER_SIZE} "
                f"to {_qatzip_abi.MAX_HW_BUFFER_SIZE} bytes, not {hw_buffer_size}"
            )
        self.hw_buffer_size = size

    @classmethod
    def available(cls) -> Availability:
        try:
            lib = _qatzip.load()
        except UnavailableError as exc:
            return Availability(False, reason=str(exc))
        if lib.hardware:
            return Availability(True, implementation=lib.implementation)
        fixes = lib.workarounds()
        return Availability(
            True, implementation=f"{lib.implementation}; thread keys {fixes['thread_keys']}; stderr filter {fixes['stderr_filter']}"
        )

    @classmethod
    def details(cls) -> dict[str, Any]:
        """Which libqatzip encodes here, and whether it drives a QAT device."""
        try:
            lib = _qatzip.load()
        except UnavailableError:
            return {"encoder": "qat", "library": None, "library_version": None, "hardware": False}
        return {
            "encoder": "qat",
            "library": lib.path,
            "library_version": lib.version,
            "hardware": lib.hardware,
            "session_status": lib.session_status,
            **lib.workarounds(),
        }

    def encode(self, buf: BufferLike) -> bytes:
        try:
            lib = _qatzip.load()
        except UnavailableError as exc:
            raise UnavailableError(f"codec 'qat' cannot encode: {exc}") from None
        if lib.budget_spent:
            return _software_gzip(as_memoryview(buf), self.level)
        return lib.compress(as_memoryview(buf), self.level, self.hw_buffer_size)


def _software_gzip(view: memoryview, level: int) -> bytes:
    """What QATzip's software fallback computes (zlib deflate in gzip), without calling QATzip.

    Used only when no QAT device is present and this process has spent
    ``_qatzip_fallback.SOFTWARE_CALL_BUDGET`` calls: libqatzip 1.3 leaks a thread key per
    software call. The stream is the same format, so any reader is unaffected.
    """
    global _budget_logged
    if not _budget_logged:
        _budget_logged = True
        logging.getLogger("kvtool.codecs").warning(
            "qat: no QAT device and libqatzip leaks a thread key per software call; after %d calls "
            "this process writes the same gzip format with zlib, as QATzip's software fallback does",
            _qatzip_fallback.SOFTWARE_CALL_BUDGET,
        )
    return _zlib_compress(view, level)


_budget_logged = False
