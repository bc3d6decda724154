"""``exphuff``: KV blocks as Huffman-coded exponents and raw sign and mantissa bits.

An array codec (it sees ``[heads, tokens, dim]`` blocks, not bytes), built for
speed on the restore path: one pass splits every float into its exponent and
the rest, the exponents of each channel are lined up on the channel's own
reference (the floor of their mean) and coded with one canonical Huffman code
per block, and the sign and mantissa bits are stored as they are. Decoding
reads four bit streams side by side, several symbols per table lookup, and
writes the floats straight into the caller's array. It takes bf16, fp16, fp32
and both fp8 types.

The C core (``kvtool._native``) does the work; without it the numpy reference
(``kvtool._native.reference``) reads and writes the same bytes, slowly. The
format is in docs/FORMAT.md.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kvtool import _native
from kvtool._native import reference
from kvtool._native.batch import BatchCodec
from kvtool.dtypes import dtype_of
from kvtool.codecs.base import NativeArrayCodec, BufferLike, as_memoryview
from kvtool.errors import DecodeError, UsageError

_CORE_ERRORS = {1: "malformed chunk", 3: "geometry the chunk does not fit"}


class ExpHuffCodec(NativeArrayCodec):
    codec_id = "exphuff"
    spec_param: ClassVar[str | None] = None
    families = reference.FAMILIES
    #: The chunk version this id writes; ``decode_array`` refuses another (the core's batch calls read both).
    chunk_version = reference.VERSION

    def batch_kernel(self, dtype: np.dtype) -> BatchCodec | None:
        return BatchCodec.of(dtype, coded=True, lane=self._lane()) if self.supports(dtype) else None

    def _lane(self) -> int:
        """Symbols per lane stream (exphuff-lanes); 0: one stream per block."""
        return 0

    def _name(self, dtype: np.dtype) -> str:
        if not self.supports(dtype):
            raise UsageError(f"codec {self.codec_id!r} codes {', '.join(reference.FAMILIES)} tensors, not {np.dtype(dtype)}")
        return dtype_of(np.dtype(dtype)).name

    def _encode_args(self) -> tuple[int, ...]:
        """Extra arguments of the core's encoder: none for version 1."""
        return ()

    def _reference_encode(self, block: np.ndarray, name: str) -> bytes:
        return reference.encode(block, name)

    def _reference_decode(self, chunk: memoryview, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return reference.decode(chunk, name, shape)

    def encode_array(self, block: np.ndarray) -> bytes:
        name = self._name(block.dtype)
        if block.ndim != 3:
            raise UsageError(f"codec {self.codec_id!r} takes [heads, tokens, dim] blocks, not shape {list(block.shape)}")
        core = _native.core()
        if core is None:
            return self._reference_encode(block, name)
        contiguous = np.ascontiguousarray(block)
        return core.exphuff_encode(_native.byte_view(contiguous), _native.DTYPE_CODES[name], *block.shape, *self._encode_args())

    def decode_array(self, buf: BufferLike, shape: tuple[int, ...], dtype: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
        name = self._name(dtype)
        if out is None:
            out = np.empty(shape, dtype)
        elif tuple(out.shape) != tuple(shape) or out.dtype != np.dtype(dtype) or not out.flags.c_contiguous:
            raise UsageError(f"{self.codec_id} decodes into a C-contiguous {list(shape)} {np.dtype(dtype)} array")
        chunk = as_memoryview(buf)
        if len(chunk) and chunk[0] != self.chunk_version:
            raise DecodeError(f"{self.codec_id}: not a chunk of this format (version {chunk[0]})")
        core = _native.core()
        if core is None:
            out.view(f"u{out.itemsize}")[...] = self._reference_decode(chunk, name, tuple(shape))
            return out
        status = core.exphuff_decode(chunk, _native.byte_view(out), _native.DTYPE_CODES[name], *shape)
        if status:
            raise DecodeError(f"{self.codec_id}: {_CORE_ERRORS.get(status, f'decoder status {status}')}")
        return out
