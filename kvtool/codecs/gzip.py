"""Gzip (RFC 1952): one wire format, encoded by the fastest implementation present.

A codec names a wire format, and the encoder that produced a stream is
provenance, not format: any gzip decoder reads what any gzip encoder wrote. So
``gzip`` is one id, and the implementation is chosen when encoding, first
available wins:

1. a QAT device, through QATzip (``kvtool.codecs._qatzip``);
2. Intel ISA-L, through the ``isal`` package (extra ``kvtool[isal]``);
3. zlib.

QATzip's software fallback is not on that list: it is zlib's deflate behind a
hardware probe that costs a thread key per call (see ``_qatzip_fallback``). The ``qat``
and ``isal`` ids name the first two implementations when one must be forced
(benchmarks); they write ``gzip`` configs, and files written before ``gzip``
existed, whose configs say ``qat`` or ``isal``, decode through them.

``level`` is the encoder's effort on zlib's scale, 0..9; ISA-L maps it onto its
own 0..3. Decode takes any gzip stream, multi-member included, under the output cap.
"""

from __future__ import annotations

import importlib
import zlib
from typing import Any, ClassVar

from kvtool.codecs.base import Availability, BufferLike, Codec, as_memoryview
from kvtool.codecs.zlib import inflate
from kvtool.errors import UnavailableError, UsageError

GZIP_WBITS = 31
ISAL_LEVELS = (0, 1, 1, 2, 2, 2, 3, 3, 3, 3)  # zlib's level -> ISA-L's


class GzipCodec(Codec):
    codec_id: ClassVar[str] = "gzip"
    params: ClassVar[tuple[str, ...]] = ("level",)
    magic = b"\x1f\x8b"
    #: Level range and default of this id's spec; ``gzip`` takes zlib's.
    levels: ClassVar[tuple[int, int]] = (0, 9)

    def __init__(self, level: int = 1):
        lo, hi = self.levels
        if not lo <= int(level) <= hi:
            raise UsageError(f"{self.codec_id} level must be in {lo}..{hi}, not {level}")
        self.level = int(level)

    @classmethod
    def config_id(cls) -> str:
        return "gzip"

    def get_config(self) -> dict[str, Any]:
        return {"id": "gzip", "level": self.level}

    @classmethod
    def available(cls) -> Availability:
        return Availability(True, implementation=_auto()[1])

    @classmethod
    def details(cls) -> dict[str, Any]:
        return {"encoder": _auto()[0]}

    def encode(self, buf: BufferLike) -> bytes:
        encoder = _auto()[0]
        view = as_memoryview(buf)
        if encoder == "qat":
            from kvtool.codecs import _qatzip, _qatzip_abi

            return _qatzip.load().compress(view, max(self.level, 1), _qatzip_abi.DEFAULT_HW_BUFFER_SIZE)
        if encoder == "isal":
            return _isal_compress(view, ISAL_LEVELS[self.level])
        return _zlib_compress(view, self.level)

    def decode(self, buf: BufferLike, max_size: int) -> bytes:
        return inflate(as_memoryview(buf), max_size, wbits=GZIP_WBITS, name="gzip", multi_member=True)


def _auto() -> tuple[str, str]:
    """The encoder ``gzip`` uses here and a description of it: QAT hardware, then ISA-L, then zlib."""
    from kvtool.codecs import _qatzip

    try:
        lib = _qatzip.load()
    except UnavailableError:
        lib = None
    if lib is not None and lib.hardware:
        return "qat", lib.implementation
    try:
        isal = importlib.import_module("isal")
    except ImportError:
        return "zlib", f"zlib {zlib.ZLIB_RUNTIME_VERSION} (no QAT device, no isal package)"
    return "isal", f"ISA-L {isal.ISAL_VERSION} (isal {isal.__version__}; no QAT device)"


def _isal_compress(view: memoryview, level: int) -> bytes:
    from isal import isal_zlib

    return isal_zlib.compress(view, level, wbits=GZIP_WBITS)


def _zlib_compress(view: memoryview, level: int) -> bytes:
    compressor = zlib.compressobj(level, zlib.DEFLATED, GZIP_WBITS)
    return compressor.compress(view) + compressor.flush()
