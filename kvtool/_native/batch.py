"""Many chunks per native call: how the container encodes a tensor and restores a cache.

Calling the core once per chunk from Python would cost more than the chunk's
coding. ``BatchCodec`` hands the core a whole tensor to cut and encode, or a
batch of chunks to verify and decode into one output array, with the GIL
released throughout, so a thread pool scales with the cores. It serves the
recipes the core implements end to end: ``exphuff``, ``exphuff-lanes`` and
``none`` (no layouts).
Every other recipe, and every recipe without the core, takes the container's
per-chunk path, which writes the same bytes.
"""

from __future__ import annotations

from types import ModuleType

from dataclasses import dataclass

import numpy as np

from kvtool import _native
from kvtool.dtypes import dtype_of
from kvtool.errors import DecodeError, UsageError


@dataclass(frozen=True)
class BatchCodec:
    core: ModuleType  # the compiled extension
    dtype_code: int
    coded: bool  # exphuff; otherwise every chunk is the block's bytes as they are
    lane: int = 0  # exphuff-lanes' symbols per lane; 0 for exphuff

    @classmethod
    def for_recipe(cls, recipe, dtype: np.dtype) -> "BatchCodec | None":
        """The batch path for ``recipe`` on ``dtype`` tensors, if the core implements it."""
        core = _native.core()
        if core is None or len(recipe.layouts) or recipe.plane_codecs:
            return None
        try:
            name = dtype_of(np.dtype(dtype)).name
        except UsageError:
            return None
        codec_id = recipe.codec.codec_id
        if name not in _native.DTYPE_CODES or codec_id not in ("exphuff", "exphuff-lanes", "none"):
            return None
        return cls(core, _native.DTYPE_CODES[name], codec_id != "none", int(getattr(recipe.codec, "lane", 0)))

    def encode_tensor(self, tensor: np.ndarray, chunk_tokens: int) -> tuple[bytes, np.ndarray]:
        """The chunks of a ``[heads, tokens, dim]`` tensor back to back, and per chunk its BLOCK_META_DTYPE record."""
        contiguous = np.ascontiguousarray(tensor)
        blob, meta = self.core.encode_blocks(
            contiguous.reshape(-1).view(np.uint8), self.dtype_code, *tensor.shape, chunk_tokens, self.coded, self.lane
        )
        return blob, np.frombuffer(meta, _native.BLOCK_META_DTYPE)

    def decode(self, src, jobs: np.ndarray, out: np.ndarray, describe) -> None:
        """Verify and decode ``jobs`` (JOB_DTYPE) from ``src`` into ``out`` ``[n, heads, tokens, dim]``.

        ``describe(i)`` names job ``i`` in an error message.
        """
        _, heads, tokens, dim = out.shape
        status, failed = self.core.decode_blocks(
            src, jobs.tobytes(), out.reshape(-1).view(np.uint8), self.dtype_code, heads, tokens, dim, True
        )
        self._raise(status, failed, describe)

    def decode_rows(self, src, jobs: np.ndarray, row_starts: np.ndarray, rows: np.ndarray, targets: list, heads: int, dim: int, describe) -> None:
        """Verify and decode ``jobs``; row (h, t) of job i goes to byte ``rows[row_starts[i] + h * tokens + t]`` of
        ``targets[out_index]`` (flat writable byte arrays)."""
        status, failed = self.core.decode_rows(
            src, jobs.tobytes(), row_starts.astype("<i8").tobytes(), rows.astype("<i8").tobytes(), targets,
            self.dtype_code, heads, dim, True,
        )
        self._raise(status, failed, describe)

    def _raise(self, status: int, failed: int, describe) -> None:
        if status == self.core.STATUS_CHECKSUM:
            raise DecodeError(f"checksum mismatch in {describe(failed)}")
        if status == self.core.STATUS_ARG:
            raise DecodeError(f"{describe(failed)} does not fit its destination")
        if status:
            raise DecodeError(f"{describe(failed)} does not decode (malformed chunk)")
