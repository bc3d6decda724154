"""Decoding exphuff-lanes chunks with the Triton kernels: descriptors, launches, status.

The host does per batch what numpy does in a few vectorised steps (each
chunk's mode, lane size and lane count, read from the chunk bytes it already
holds) and two kernel launches; the GPU does the rest, straight into the
destination. ``decode_chunks`` is the same path into plain ``[heads, tokens,
dim]`` arrays, for tests and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import triton

from kvtool._native.lanes_reference import MAX_LANE, MIN_LANE
from kvtool._native.reference import FAMILIES
from kvtool.errors import DecodeError
from kvtool.gpu import interpreted, kernels
from kvtool.gpu.kernels import (
    DESC_FIELDS, DESC_LANE_BASE, DESC_LANES, DESC_LENGTH, DESC_OFFSET, DESC_ROW_START, DESC_STORED_RAW, DESC_TOKENS,
)

#: Lanes per decode program (the interpreter runs programs one after another: fewer, wider ones there),
#: and per step of the lane-table scan.
LANES = 1024 if interpreted() else 128
LANE_TILE = 1024
#: A one-symbol or stored-raw chunk has no lanes; its values are written by this many threads per step.
ONE_SYMBOL_LANES = 1024
#: The destination's element type per value width (bit patterns: the kernels never do float arithmetic).
ELEMENT = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}
_STATUS_WORDS = {
    kernels.STATUS_HEADER: "not an exphuff-lanes chunk or a bad header",
    kernels.STATUS_TABLE: "a bad code table",
    kernels.STATUS_LANES: "a lane's length does not match its symbols",
    kernels.STATUS_LENGTH: "lengths that do not add up to the chunk",
}


@dataclass(frozen=True)
class Batch:
    """Chunks of one dtype and ``[heads, *, dim]`` geometry bound for one destination."""

    desc: np.ndarray  # [chunks, DESC_FIELDS] int64
    lanes: int  # lanes of all chunks together
    widest: int  # lanes of the chunk with the most


def describe(blob: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, tokens: np.ndarray, row_starts: np.ndarray,
             dtype_name: str, heads: int, dim: int, stored_raw: np.ndarray | None = None) -> Batch:
    """The descriptors of chunks at ``offsets`` (``lengths`` bytes, ``tokens`` tokens each) of the host bytes
    ``blob``, their rows from ``row_starts``; ``stored_raw`` marks chunks the container stored as they are
    (their length checked against their values' by the container). Lane counts come from each chunk's own header; the kernels
    check them against it again, so a damaged header costs a failed status, never a stray read."""
    family = FAMILIES[dtype_name]
    offsets, lengths, tokens = (np.asarray(a, np.int64) for a in (offsets, lengths, tokens))
    n = heads * tokens * dim
    fixed = 2 + heads * dim + n * family.raw_bytes

    def byte(at: np.ndarray) -> np.ndarray:
        inside = (at >= 0) & (at < offsets + lengths) & (at < blob.size)
        return np.where(inside, blob[np.where(inside, at, 0)], 0).astype(np.int64)

    mode = byte(offsets + 1)
    lane = byte(offsets + fixed) | byte(offsets + fixed + 1) << 8
    lane = np.clip(lane, MIN_LANE, MAX_LANE)
    raw = np.zeros(len(offsets), np.int64) if stored_raw is None else np.asarray(stored_raw, np.int64)
    k = np.where((mode == 0) & (raw == 0), -(-n // lane), np.minimum(n, ONE_SYMBOL_LANES))
    desc = np.zeros((len(offsets), DESC_FIELDS), np.int64)
    desc[:, DESC_OFFSET], desc[:, DESC_LENGTH], desc[:, DESC_TOKENS] = offsets, lengths, tokens
    desc[:, DESC_LANES], desc[:, DESC_LANE_BASE] = k, np.cumsum(k) - k
    desc[:, DESC_ROW_START], desc[:, DESC_STORED_RAW] = row_starts, raw
    return Batch(desc, int(k.sum()), int(k.max()) if len(k) else 0)


@dataclass
class Scratch:
    """Device memory of one batch's decode: descriptors, decode tables, lane starts, status words."""

    desc: torch.Tensor
    table: torch.Tensor
    lane_start: torch.Tensor
    status: torch.Tensor

    @classmethod
    def for_batch(cls, batch: Batch, device: torch.device) -> "Scratch":
        count = len(batch.desc)
        return cls(
            torch.from_numpy(batch.desc).to(device, non_blocking=True),
            torch.empty(max(count, 1) * kernels.TABLE_SLOTS, dtype=torch.int32, device=device),
            torch.empty(batch.lanes + 1, dtype=torch.int64, device=device),
            torch.zeros(count, dtype=torch.int32, device=device),
        )


def run_kernels(src: torch.Tensor, batch: Batch, scratch: Scratch, first: int, last: int, rows: torch.Tensor,
                dst: torch.Tensor, row_base: int, dtype_name: str, heads: int, dim: int) -> None:
    """Queue, on the current stream, the decode of chunks ``first..last-1`` of ``batch`` from device bytes ``src``
    into ``dst`` (flat, of ``ELEMENT[width]``): a chunk's row r goes to element ``row_base + rows[row_start + r]``
    (a negative entry leaves the row out)."""
    count = last - first
    widest = int(batch.desc[first:last, DESC_LANES].max()) if count else 0
    if not widest:
        return
    family = FAMILIES[dtype_name]
    desc, status = scratch.desc[first:last], scratch.status[first:last]
    table = scratch.table[first * kernels.TABLE_SLOTS : last * kernels.TABLE_SLOTS]
    kernels.code_table_kernel[(count,)](src, desc, table, scratch.lane_start, status, HEADS=heads, DIM=dim,
                                        RAW_BYTES=family.raw_bytes, LANE_TILE=LANE_TILE)
    kernels.decode_kernel[(triton.cdiv(widest, LANES), count)](
        src, desc, table, scratch.lane_start, status, rows, dst, row_base, HEADS=heads, DIM=dim,
        WIDTH=family.width, RAW_BYTES=family.raw_bytes, EMASK=family.emask, ESHIFT=family.eshift, LANES=LANES,
    )


def check(status: torch.Tensor, name_of: Callable[[int], str] = lambda i: f"chunk {i}") -> None:
    """Raise ``DecodeError`` naming the first chunk whose status is not OK (waits for the kernels)."""
    words = status.cpu().numpy()
    bad = np.flatnonzero(words)
    if len(bad):
        word = int(words[bad[0]])
        why = "; ".join(text for bit, text in _STATUS_WORDS.items() if word & bit)
        raise DecodeError(f"exphuff-lanes: {name_of(int(bad[0]))} does not decode on the GPU ({why})")


def decode_chunks(chunks: list[bytes], shapes: list[tuple[int, int, int]], dtype_name: str,
                  device: str | torch.device = "cpu") -> list[np.ndarray]:
    """Each chunk decoded by the kernels into its own ``[heads, tokens, dim]`` array (of unsigned integers of
    the dtype's width); all shapes share heads and dim. ``DecodeError`` if any is malformed."""
    family = FAMILIES[dtype_name]
    heads, _, dim = shapes[0] if shapes else (0, 0, 0)
    lengths = np.array([len(c) for c in chunks], np.int64)
    offsets = np.cumsum(lengths) - lengths
    tokens = np.array([s[1] for s in shapes], np.int64)
    blob = np.frombuffer(b"".join(chunks), np.uint8)
    row_counts = heads * tokens
    row_starts = np.cumsum(row_counts) - row_counts
    batch = describe(blob, offsets, lengths, tokens, row_starts, dtype_name, heads, dim)
    rows = torch.arange(int(row_counts.sum()), dtype=torch.int64) * dim
    dst = torch.zeros(int(row_counts.sum()) * dim, dtype=ELEMENT[family.width], device=device)
    src = torch.from_numpy(blob.copy()).to(device)
    scratch = Scratch.for_batch(batch, torch.device(device))
    run_kernels(src, batch, scratch, 0, len(chunks), rows.to(device), dst, 0, dtype_name, heads, dim)
    check(scratch.status)
    flat = dst.cpu().numpy()
    out, at = [], 0
    for shape in shapes:
        size = shape[0] * shape[1] * shape[2]
        out.append(flat[at : at + size].reshape(shape))
        at += size
    return out
