"""Many chunks per native call: how the container encodes a tensor and restores a cache.

Calling the core once per chunk from Python would cost more than the chunk's
coding. ``BatchCodec`` hands the core a whole tensor to cut and encode, or a
batch of chunks to verify and decode into one output array, with the GIL
released throughout, so a thread pool scales with the cores. It serves the
codecs whose class offers it (``Codec.batch_kernel``: today exphuff, exphuff-lanes,
ctxtans with its dictionary's tables, built once, and none), in recipes with no
layouts. Every other recipe, and every recipe without the core, takes the .kvz
reader's and writer's per-chunk path, which writes the same bytes. The core's job records
(``JOB_DTYPE``) are built here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from kvtool import _native
from kvtool._native.core_api import CoderModel, NativeCore
from kvtool.dtypes import dtype_of
from kvtool.errors import DecodeError, UsageError

Buffer = Union[bytes, bytearray, memoryview]


@dataclass(frozen=True)
class BatchCodec:
    core: NativeCore  # the compiled extension
    dtype_code: int
    coded: bool  # exphuff, exphuff-lanes or ctxtans; otherwise every chunk is the block's bytes as they are
    model: Optional[CoderModel] = None  # ctxtans: the core's copy of its dictionary's tables; None: exphuff
    lane: int = 0  # exphuff-lanes' symbols per lane; 0 for exphuff

    @classmethod
    def of(cls, dtype: np.dtype, coded: bool, model: Optional[CoderModel] = None, lane: int = 0) -> "BatchCodec | None":
        """The core's batch kernel for tensors of ``dtype`` (``coded``: exphuff's chunk versions, or ctxtans's with
        ``model``; otherwise every chunk is the block's bytes), or None where the core is off or lacks the dtype."""
        core = _native.core()
        try:
            name = dtype_of(np.dtype(dtype)).name
        except UsageError:
            return None
        if core is None or name not in _native.DTYPE_CODES:
            return None
        return cls(core, _native.DTYPE_CODES[name], coded, model, lane)

    def encode_tensor(self, tensor: np.ndarray, chunk_tokens: int) -> tuple[bytes, np.ndarray]:
        """The chunks of a ``[heads, tokens, dim]`` tensor back to back, and per chunk its BLOCK_META_DTYPE record."""
        contiguous = np.ascontiguousarray(tensor)
        heads, tokens, dim = tensor.shape
        blob, meta = self.core.encode_blocks(
            contiguous.reshape(-1).view(np.uint8), self.dtype_code, heads, tokens, dim, chunk_tokens, self.coded, self.model,
            self.lane,
        )
        return blob, np.frombuffer(meta, _native.BLOCK_META_DTYPE)

    def decode(self, src: Buffer, chunks: Chunks, out: np.ndarray) -> None:
        """Verify and decode ``chunks`` from ``src`` into ``out`` ``[n, heads, tokens, dim]``: chunk i to
        tensor ``chunks.out_index[i]`` at token ``chunks.block_start[i]``, clipped to the tensor's tokens."""
        _, heads, tokens, dim = out.shape
        status, failed = self.core.decode_blocks(
            src, _jobs(chunks), out.reshape(-1).view(np.uint8), self.dtype_code, heads, tokens, dim, True, self.model
        )
        raise_for_status(self.core, status, failed)

    def decode_rows(self, src: Buffer, chunks: Chunks, row_starts: np.ndarray, rows: np.ndarray, targets: list[np.ndarray],
                    heads: int, dim: int) -> None:
        """Verify and decode ``chunks``; row (h, t) of chunk i goes to byte ``rows[row_starts[i] + h * tokens + t]`` of
        ``targets[chunks.out_index[i]]`` (flat writable byte arrays), or nowhere where that offset is negative."""
        status, failed = self.core.decode_rows(
            src, _jobs(chunks), _int64(row_starts), _int64(rows), targets, self.dtype_code, heads, dim, True, self.model,
        )
        raise_for_status(self.core, status, failed)



def raise_for_status(core: NativeCore, status: int, failed: int) -> None:
    """The ``ChunkDecodeError`` a batch call's status means (nothing for 0); ``failed``: the job that failed."""
    if status == core.STATUS_CHECKSUM:
        raise ChunkDecodeError("checksum mismatch", failed, "checksum")
    if status == core.STATUS_ARG:
        raise ChunkDecodeError("does not fit its destination", failed, "destination")
    if status:
        raise ChunkDecodeError("does not decode (malformed chunk)", failed, "malformed")


def place_rows(block: np.ndarray, offsets: np.ndarray, target: np.ndarray) -> bool:
    """Row (h, t) of a C-contiguous ``[heads, tokens, dim]`` block to byte ``offsets[h * tokens + t]`` of the
    flat byte array ``target`` (none where negative), in one call of the core; False where the core is
    off or does not know the dtype. Every offset is checked against the target before a byte moves."""
    core = _native.core()
    try:
        code = _native.DTYPE_CODES[dtype_of(block.dtype).name]
    except (KeyError, UsageError):
        return False
    if core is None:
        return False
    heads, tokens, dim = block.shape
    one = np.zeros(1, np.int64)
    chunk = Chunks(one, np.array([block.nbytes]), one, one, np.ones(1, bool), np.array([tokens]), one, one)
    status, _ = core.decode_rows(_native.byte_view(block), _jobs(chunk), _int64(one), _int64(offsets), [target], code,
                                 heads, dim, False)
    if status:
        raise ChunkDecodeError("does not fit its destination", 0, "destination")
    return True


@dataclass(frozen=True)
class Chunks:
    """Chunks to decode, one array each field, in the order they lie in the source buffer."""

    offset: np.ndarray  # in the source buffer
    stored_len: np.ndarray
    stored_xxh3: np.ndarray
    raw_xxh3: np.ndarray
    stored_raw: np.ndarray  # bool: the block's bytes as they are
    block_tokens: np.ndarray
    out_index: np.ndarray  # which destination tensor (or target)
    block_start: np.ndarray  # the destination token of the block's first token; may be negative


class ChunkDecodeError(DecodeError):
    """A chunk of a batch failed: ``job`` is its position in the batch, ``reason`` one of
    ``checksum``, ``destination`` or ``malformed``."""

    def __init__(self, message: str, job: int, reason: str):
        super().__init__(message)
        self.job = job
        self.reason = reason


def _int64(values: np.ndarray) -> np.ndarray:
    """``values`` as the core reads offsets: C-contiguous little-endian int64, copied only where they are not."""
    return np.ascontiguousarray(values, dtype="<i8")


def _jobs(chunks: Chunks) -> np.ndarray:
    """The C core's job records (JOB_DTYPE) of ``chunks``."""
    jobs = np.zeros(len(chunks.offset), _native.JOB_DTYPE)
    jobs["offset"] = chunks.offset
    jobs["stored_len"] = chunks.stored_len
    jobs["stored_xxh3"] = chunks.stored_xxh3
    jobs["raw_xxh3"] = chunks.raw_xxh3
    jobs["out_index"] = chunks.out_index
    jobs["flags"] = np.where(chunks.stored_raw, _native.JOB_STORED_RAW, 0)
    jobs["block_tokens"] = chunks.block_tokens
    jobs["block_start"] = chunks.block_start
    return jobs
