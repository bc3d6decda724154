"""The identity codec: stores bytes as they are."""

from __future__ import annotations

import numpy as np

from kvtool._native.batch import BatchCodec
from kvtool.codecs.base import BufferLike, Codec, as_memoryview, check_output_size


class NoneCodec(Codec):
    codec_id = "none"
    spec_param = None
    # Raw bytes carry no checksum; the .kvz container and the store check them instead.
    self_checking = False

    def batch_kernel(self, dtype: np.dtype) -> BatchCodec | None:
        return BatchCodec.of(dtype, coded=False)

    def encode(self, buf: BufferLike) -> bytes:
        return bytes(as_memoryview(buf))

    def decode(self, buf: BufferLike, max_size: int) -> bytes:
        view = as_memoryview(buf)
        check_output_size(len(view), max_size)
        return bytes(view)
