"""Gzip through Intel ISA-L, via the ``isal`` package (extra ``kvtool[isal]``).

Levels 0..3 are ISA-L's own. The output is standard gzip, so ``gzip -d`` and
the qat codec read it; decode takes any gzip stream, multi-member included,
under the output cap.
"""

from __future__ import annotations

import isal
from isal import isal_zlib

from kvtool.codecs.base import Availability, BufferLike, Codec, as_memoryview
from kvtool.codecs.zlib import inflate
from kvtool.errors import UsageError


class IsalCodec(Codec):
    codec_id = "isal"
    params = ("level",)
    magic = b"\x1f\x8b"

    def __init__(self, level: int = 1):
        lo, hi = isal_zlib.ISAL_BEST_SPEED, isal_zlib.ISAL_BEST_COMPRESSION
        if not lo <= int(level) <= hi:
            raise UsageError(f"isal level must be in {lo}..{hi}, not {level}")
        self.level = int(level)

    @classmethod
    def available(cls) -> Availability:
        return Availability(True, implementation=f"ISA-L {isal.ISAL_VERSION} (isal {isal.__version__})")

    def encode(self, buf: BufferLike) -> bytes:
        return isal_zlib.compress(as_memoryview(buf), self.level, wbits=31)

    def decode(self, buf: BufferLike, max_size: int) -> bytes:
        return inflate(as_memoryview(buf), max_size, wbits=31, name="gzip", multi_member=True, backend=isal_zlib)
