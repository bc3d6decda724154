"""Gzip through Intel ISA-L, forced (``isal``), via the ``isal`` package (extra ``kvtool[isal]``).

The format is gzip: this codec writes ``gzip`` configs, and its id stays to read
files written before ``gzip`` existed and to force ISA-L in benchmarks. Levels
0..3 are ISA-L's own.
"""

from __future__ import annotations

from typing import ClassVar

import isal

from kvtool.codecs.base import Availability, BufferLike, as_memoryview
from kvtool.codecs.gzip import GzipCodec, _isal_compress


class IsalCodec(GzipCodec):
    codec_id: ClassVar[str] = "isal"
    levels: ClassVar[tuple[int, int]] = (0, 3)

    @classmethod
    def available(cls) -> Availability:
        return Availability(True, implementation=f"ISA-L {isal.ISAL_VERSION} (isal {isal.__version__})")

    @classmethod
    def details(cls) -> dict:
        return {"encoder": "isal"}

    def encode(self, buf: BufferLike) -> bytes:
        return _isal_compress(as_memoryview(buf), self.level)
