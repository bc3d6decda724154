"""The chunk pipeline: how a reader turns selected token blocks into their destination.

As zarr's ``BatchedCodecPipeline``, it is chosen once, when a reader opens, by
asking the recipe's stages what they can do (``kvtool.kvz.reader.pipeline_for``):
the native batch (the core verifies and decodes many chunks per call: a codec
with a ``batch_kernel``, or the ``int`` stage's in ``kvtool.kvz.int_pipeline``) or
per chunk (any recipe: the codecs, then the layout chain's inverse writing into
the destination through ``decode_array(out=)`` and ``inverse_into``). Both take
one ``decode(blocks, destination)``; the destination (``kvtool.destinations``)
says how its bytes are addressed: one array, rows at offsets, or blocks handed
over one at a time. A destination that decodes a recipe's stored chunks itself
(GPU pages) gets them, each chunk's checksum verified, instead.

The native batch fetches blocks in runs of about ``READ_RUN`` stored bytes, the
per-chunk pipeline one block at a time, so memory beyond the destination is a
run and one block per thread, whatever the file's size.
"""

from __future__ import annotations

import abc
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TypeVar

import numpy as np

from kvtool._native import xxh3_64
from kvtool._native.batch import BatchCodec, ChunkDecodeError, Chunks
from kvtool.destinations import Destination, StoredChunks
from kvtool.errors import DecodeError, UsageError
from kvtool.kvz.format import FLAG_STORED_RAW, KvzCorruptError
from kvtool.kvz.header import KvzHeader
from kvtool.kvz.sources import READ_RUN, Buffer, ByteSource
from kvtool.layouts.base import PlaneSpec

#: Blocks that decode to more than this go one at a time (real caches' blocks are well below a MiB).
LARGE_BLOCK = 64 << 20
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Blocks:
    """Token blocks to decode, sorted by where they lie in the file: block i is the one of manifest
    tensor ``tensor[i]`` starting at token ``start[i]``, for tensor ``position[i]`` of the destination,
    where its first token lands at ``token[i]`` (negative when the read begins inside it)."""

    tensor: np.ndarray
    start: np.ndarray
    position: np.ndarray
    token: np.ndarray


class ChunkPipeline(abc.ABC):
    #: Blocks are fetched in runs of about this many stored bytes (one block at least).
    run_bytes = READ_RUN

    def __init__(self, header: KvzHeader):
        self.header = header
        self._scratch = threading.local()

    def decode(self, source: ByteSource, blocks: Blocks, destination: Destination, threads: int | None = None,
               on_progress: Callable[[int], None] | None = None) -> None:
        """Verify and decode ``blocks`` into ``destination``, runs of blocks on ``threads`` workers."""
        h = self.header
        first, tokens, planes = h.block_rows(blocks.tensor, blocks.start)
        if destination.takes_stored(h.recipe):
            destination.put_stored(self._stored(source, blocks, first, tokens))
            return
        last = first + planes - 1
        begin = h.index["offset"][first].astype(np.int64)
        end = (h.index["offset"][last] + h.index["stored_len"][last]).astype(np.int64)
        if len(tokens) and int(tokens.max()) * h.heads * h.dim * h.dtype.itemsize > LARGE_BLOCK:
            threads = 1  # one such block in flight, not one per worker: memory stays at the destination and a block
        workers = threads or os.cpu_count() or 1
        limit = self.run_bytes
        if workers > 1 and limit and len(begin):  # several workers share even one entry: a run each at least
            limit = min(limit, max(1, -(-int(end.max() - begin.min()) // workers)))
        runs = _runs(begin, end, limit)

        def run(span: tuple[int, int]) -> int:
            lo, hi = span
            base = int(begin[lo])
            data = source.read_run(base, int(end[hi - 1]) - base)
            self._decode_run(data, base, first[lo:hi], tokens[lo:hi], blocks, lo, destination)
            return int(tokens[lo:hi].sum()) * h.heads * h.dim * h.dtype.itemsize

        for _, nbytes in map_bounded(run, runs, threads):
            if on_progress:
                on_progress(nbytes)

    @abc.abstractmethod
    def _decode_run(self, data: Buffer, base: int, first: np.ndarray, tokens: np.ndarray, blocks: Blocks, lo: int,
                    destination: Destination) -> None:
        """Decode blocks ``lo..lo + len(first)``, whose stored bytes are ``data`` (from file offset ``base``)."""

    def _stored(self, source: ByteSource, blocks: Blocks, first: np.ndarray, tokens: np.ndarray) -> StoredChunks:
        """The blocks' chunks (one plane each: a recipe whose chunks a destination decodes itself has no layouts), read
        in one run and each checked against its stored checksum: the only pass over their bytes on the host."""
        h = self.header
        entries = h.index[first]
        offset = entries["offset"].astype(np.int64)
        length = entries["stored_len"].astype(np.int64)
        base = int(offset.min()) if len(offset) else 0
        end = int((offset + length).max()) if len(offset) else 0
        data = np.frombuffer(source.read(base, end - base), np.uint8)
        offset -= base
        for i, (at, n) in enumerate(zip(offset.tolist(), length.tolist())):
            if xxh3_64(data[at : at + n]) != int(entries["stored_xxh3"][i]):
                row = int(first[i])
                raise h.chunk_error(KvzCorruptError, row, f"checksum mismatch in {h.describe(row)}")
        return StoredChunks(data, blocks.position, blocks.token, offset, length, tokens.astype(np.int64),
                            (entries["flags"] & FLAG_STORED_RAW) != 0, h.heads, h.dim, h.dtype.name)

    def scratch(self, tokens: int) -> np.ndarray:
        """A C-contiguous ``[heads, tokens, dim]`` block this thread reuses."""
        h = self.header
        block: np.ndarray | None = getattr(self._scratch, "block", None)
        if block is None or block.shape[1] != tokens:
            block = self._scratch.block = np.empty((h.heads, tokens, h.dim), h.dtype.numpy)
        return block


class NativeBatch(ChunkPipeline):
    """The core verifies and decodes a run's chunks in one call, straight into the destination."""

    def __init__(self, header: KvzHeader, batch: BatchCodec):
        super().__init__(header)
        self.batch = batch

    def _decode_run(self, data: Buffer, base: int, first: np.ndarray, tokens: np.ndarray, blocks: Blocks, lo: int,
                    destination: Destination) -> None:
        h, hi = self.header, lo + len(first)
        entries = h.index[first]
        positions, starts = blocks.position[lo:hi], blocks.token[lo:hi]
        try:
            arena = destination.array()
            run = None if arena is not None else destination.rows(positions, starts, tokens)
            if arena is not None:
                self.batch.decode(data, _chunks(entries, base, positions, starts), arena)
            elif run is not None:
                zero = np.zeros(len(first), np.int64)
                self.batch.decode_rows(data, _chunks(entries, base, run.out_index, zero), run.starts, run.rows,
                                       list(run.targets), h.heads, h.dim)
            else:
                zero = np.zeros(1, np.int64)
                for i in range(len(first)):
                    block = self.scratch(int(tokens[i]))
                    try:
                        self.batch.decode(data, _chunks(entries[i : i + 1], base, zero, zero), block[None])
                    except ChunkDecodeError as exc:
                        raise ChunkDecodeError(str(exc), i, exc.reason) from None
                    destination.put(int(positions[i]), int(starts[i]), block)
        except ChunkDecodeError as exc:
            row = int(first[exc.job])
            message = f"checksum mismatch in {h.describe(row)}" if exc.reason == "checksum" else f"{h.describe(row)} {exc}"
            raise h.chunk_error(KvzCorruptError, row, message) from None


def _chunks(entries: np.ndarray, base: int, out_index: np.ndarray, block_start: np.ndarray) -> Chunks:
    """Index records as the core's batch takes them, offsets counted from ``base``."""
    return Chunks(entries["offset"].astype(np.int64) - base, entries["stored_len"], entries["stored_xxh3"], entries["raw_xxh3"],
                  (entries["flags"] & FLAG_STORED_RAW) != 0, entries["token_count"], out_index, block_start)


class PerChunk(ChunkPipeline):
    """Any recipe: each block's planes through their codecs, then the layout chain's inverse into the
    destination's own memory for the block (``view``), or into a block-sized scratch this thread reuses,
    then handed to it (``put``). Blocks are fetched one at a time: Python's work per block
    dwarfs a read, and memory beyond the destination stays at about one block."""

    run_bytes = 0

    def _decode_run(self, data: Buffer, base: int, first: np.ndarray, tokens: np.ndarray, blocks: Blocks, lo: int,
                    destination: Destination) -> None:
        for i, (row, n) in enumerate(zip(first.tolist(), tokens.tolist())):
            position, token = int(blocks.position[lo + i]), int(blocks.token[lo + i])
            target = destination.view(position, token, n)
            out = target if target is not None else self.scratch(n)
            layer, kind, _ = self.header.tensors[int(blocks.tensor[lo + i])]
            self.decode_block(data, base, row, n, layer, kind, out)
            if target is not None:
                continue
            try:
                destination.put(position, token, out)
            except ChunkDecodeError:
                raise self.header.chunk_error(KvzCorruptError, row, f"{self.header.describe(row)} does not fit its destination") from None

    def decode_block(self, data: Buffer, base: int, row: int, tokens: int, layer: int, kind: str, out: np.ndarray) -> None:
        """Verify and decode the block whose first plane is index record ``row`` into ``out``."""
        h = self.header
        specs = h.planes_for(tokens)
        block_spec = PlaneSpec("data", (h.heads, tokens, h.dim), h.dtype.numpy)
        layouts = h.recipe.layouts.for_kind(kind, layer)
        direct = h.recipe.array_codec is not None and not len(layouts)  # the codec writes the block itself
        planes: list[np.ndarray] = []
        for r, spec in enumerate(specs, row):
            entry = h.index[r]
            at = int(entry["offset"]) - base
            stored = memoryview(data)[at : at + int(entry["stored_len"])]
            if xxh3_64(stored) != int(entry["stored_xxh3"]):
                raise h.chunk_error(KvzCorruptError, r, f"checksum mismatch in {h.describe(r)}")
            if entry["flags"] & FLAG_STORED_RAW:
                planes.append(np.frombuffer(stored, dtype=spec.dtype).reshape(spec.shape))
                continue  # its checksum, just verified, is the raw checksum too
            raw: Buffer | np.ndarray
            plane: np.ndarray | None
            try:
                if h.recipe.array_codec is not None:
                    plane = h.recipe.array_codec.decode_array(stored, spec.shape, spec.dtype, out=out if direct else None)
                    raw = plane.reshape(-1).view(np.uint8)
                else:
                    raw = h.recipe.codec_for(spec.name).decode(stored, max_size=int(entry["raw_len"]))
                    plane = np.frombuffer(raw, dtype=spec.dtype).reshape(spec.shape) if len(raw) == spec.nbytes else None
            except (DecodeError, UsageError) as exc:
                raise h.chunk_error(KvzCorruptError, r, f"{h.describe(r)} does not decode: {exc}") from None
            if len(raw) != entry["raw_len"] or xxh3_64(raw) != int(entry["raw_xxh3"]):
                raise h.chunk_error(KvzCorruptError, r, f"{h.describe(r)} decodes to different bytes than were written")
            assert plane is not None  # a raw length other than the plane's failed the check above
            planes.append(plane)
        if direct and not (h.index[row]["flags"] & FLAG_STORED_RAW):
            return
        try:
            layouts.inverse_into(planes, block_spec, out)
        except DecodeError as exc:
            raise h.chunk_error(KvzCorruptError, row, f"{h.describe(row)} does not decode: {exc}") from None


def checked_plane(h: KvzHeader, codec: Any, stored: memoryview, r: int, stored_raw: bool) -> Buffer:
    """Index record ``r``'s plane for a stage's batch: its stored checksum checked, decompressed by ``codec`` unless
    stored raw, its size checked (its raw checksum is the caller's, or the core's)."""
    entry = h.index[r]
    if xxh3_64(stored) != int(entry["stored_xxh3"]):
        raise h.chunk_error(KvzCorruptError, r, f"checksum mismatch in {h.describe(r)}")
    if stored_raw:
        return stored  # its checksum, just verified, is the raw checksum too
    try:
        raw: Buffer = codec.decode(stored, max_size=int(entry["raw_len"]))
    except (DecodeError, UsageError) as exc:
        raise h.chunk_error(KvzCorruptError, r, f"{h.describe(r)} does not decode: {exc}") from None
    if len(raw) != int(entry["raw_len"]):
        raise h.chunk_error(KvzCorruptError, r, f"{h.describe(r)} decodes to different bytes than were written")
    return raw


def _runs(begin: np.ndarray, end: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Split blocks sorted by offset into ``(lo, hi)`` runs of adjacent blocks of about ``limit`` bytes."""
    if len(begin) and int(end[-1] - begin[0]) <= limit and not np.any(begin[1:] != end[:-1]):
        return [(0, len(begin))]  # all adjacent, all within the limit: one run (a whole entry's read)
    runs, lo, size = [], 0, 0
    for i in range(len(begin)):
        adjacent = i == lo or begin[i] == end[i - 1]
        if not adjacent or (size and size + int(end[i] - begin[i]) > limit):
            runs.append((lo, i))
            lo, size = i, 0
        size += int(end[i] - begin[i])
    if len(begin):
        runs.append((lo, len(begin)))
    return runs


def map_bounded(fn: Callable[[T], R], items: Iterable[T], threads: int | None) -> Iterator[tuple[T, R]]:
    """``(item, fn(item))`` in order, computed on a pool with a bounded number in flight."""
    if threads is not None and (type(threads) is not int or threads < 0):
        raise UsageError(f"threads must be a whole number, 0 or None for one per core, not {threads!r}")
    workers = threads or os.cpu_count() or 1
    if workers == 1:
        for item in items:
            yield item, fn(item)
        return
    with ThreadPoolExecutor(workers) as pool:
        pending: list[tuple[T, Future[R]]] = []
        for item in items:
            pending.append((item, pool.submit(fn, item)))
            if len(pending) >= 4 * workers:
                first, future = pending.pop(0)
                yield first, future.result()
        for item, future in pending:
            yield item, future.result()
