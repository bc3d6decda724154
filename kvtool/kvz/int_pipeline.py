"""The lossy ``int`` stage's batch pipeline: a run of blocks through zstd, then one native call into the destination.

Per run of about ``READ_RUN`` stored bytes: each plane's stored checksum is
checked and its zstd frame decompressed (both release the GIL), then the core
(``IntBatchCodec``) checks every raw checksum and writes every block's values
straight into the destination, its rows computed here for each kind of
destination. The checks, their order and their messages are the per-chunk
path's; a run holding a block the core declines (non-finite scales, only in
crafted files) is decoded per chunk, by the numpy reference, as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtool._native import xxh3_64
from kvtool._native.batch import Buffer, ChunkDecodeError
from kvtool._native.int_batch import VERIFY_CODES, VERIFY_SCALES, Declined, IntBatchCodec, int_jobs
from kvtool.errors import DecodeError, UsageError
from kvtool.kvz.format import FLAG_STORED_RAW, KvzCorruptError
from kvtool.kvz.header import KvzHeader
from kvtool.kvz.pipeline import Blocks, Destination, Each, PerChunk, Tensors
from kvtool.kvz.sources import READ_RUN


class IntBatch(PerChunk):
    """``int:B,...|zstd`` recipes: runs of blocks restored by the core, straight into the destination."""

    run_bytes = READ_RUN

    def __init__(self, header: KvzHeader, batch: IntBatchCodec):
        super().__init__(header)
        self.batch = batch
        stages: list[Any] = [header.recipe.layouts.for_kind(kind, layer)[0] for layer, kind, _ in header.tensors]
        self._bits = [stage.code_bits for stage in stages]  # per manifest tensor
        self._channel = [stage.axis == "channel" for stage in stages]

    def _decode_run(self, data: Buffer, base: int, first: np.ndarray, tokens: np.ndarray, blocks: Blocks, lo: int,
                    destination: Destination) -> None:
        h = self.header
        row_bytes = h.dim * h.dtype.itemsize
        if isinstance(destination, Each):  # a block at a time, through this thread's scratch
            for i in range(len(first)):
                block = self.scratch(int(tokens[i]))
                in_order = np.arange(h.heads * int(tokens[i]), dtype=np.int64) * row_bytes
                try:
                    self._restore(data, base, first[i : i + 1], tokens[i : i + 1], blocks, lo + i, [in_order], [0],
                                  [block.reshape(-1).view(np.uint8)])
                except Declined:
                    super()._decode_run(data, base, first[i : i + 1], tokens[i : i + 1], blocks, lo + i, destination)
                    continue
                destination.fn(int(blocks.position[lo + i]), int(blocks.token[lo + i]), block)
            return
        positions, starts = blocks.position[lo : lo + len(first)], blocks.token[lo : lo + len(first)]
        try:
            if isinstance(destination, Tensors):
                arena = destination.array
                offsets = [_tensor_rows(arena.shape, int(p), int(s), int(n), row_bytes) for p, s, n in zip(positions, starts, tokens)]
                self._restore(data, base, first, tokens, blocks, lo, offsets, [0] * len(first),
                              [arena.reshape(-1).view(np.uint8)])
            else:
                offsets = [destination.rows[p, :, s : s + n].reshape(-1) for p, s, n in zip(positions, starts, tokens)]
                self._restore(data, base, first, tokens, blocks, lo, offsets, [destination.target_of[p] for p in positions],
                              list(destination.targets))
        except Declined:  # the whole run again, per chunk: what the batch wrote is written again, the same
            super()._decode_run(data, base, first, tokens, blocks, lo, destination)

    def _restore(self, data: Buffer, base: int, first: np.ndarray, tokens: np.ndarray, blocks: Blocks, lo: int,
                 offsets: list[np.ndarray], out_index: list[int], targets: list[np.ndarray]) -> None:
        """Blocks ``lo..`` (first index records ``first``) to their rows ``offsets`` in ``targets[out_index]``."""
        h = self.header
        view = memoryview(data)
        jobs = int_jobs(len(first))
        planes: list[Buffer] = []
        for i, (row, n) in enumerate(zip(first.tolist(), tokens.tolist())):
            tensor = int(blocks.tensor[lo + i])
            specs = h.planes_for(n)
            flags = 0
            for r, verify in zip((row, row + 1), (VERIFY_CODES, VERIFY_SCALES)):
                planes.append(self._plane(view, base, r))
                flags |= 0 if h.index[r]["flags"] & FLAG_STORED_RAW else verify
            job = jobs[i]
            job["codes_xxh3"], job["scales_xxh3"] = h.index[row]["raw_xxh3"], h.index[row + 1]["raw_xxh3"]
            job["out_index"], job["block_tokens"], job["groups_per_head"] = out_index[i], n, specs[1].shape[1]
            job["bits"], job["channel_axis"], job["flags"] = self._bits[tensor], self._channel[tensor], flags
        jobs["row_start"] = np.cumsum([0] + [len(o) for o in offsets[:-1]])
        try:
            self.batch.decode(planes, jobs, np.concatenate(offsets), targets, h.heads, h.dim)
        except ChunkDecodeError as exc:
            row = int(first[exc.job])
            if exc.reason == "checksum":
                row += int(xxh3_64(planes[2 * exc.job]) == int(h.index[row]["raw_xxh3"]))  # the codes, or the scales
                raise h.chunk_error(KvzCorruptError, row, f"{h.describe(row)} decodes to different bytes than were written") from None
            raise h.chunk_error(KvzCorruptError, row, f"{h.describe(row)} {exc}") from None

    def _plane(self, view: memoryview, base: int, r: int) -> Buffer:
        """Index record ``r``'s plane: its stored checksum checked, decompressed unless stored raw, its size checked."""
        h = self.header
        entry = h.index[r]
        at = int(entry["offset"]) - base
        stored = view[at : at + int(entry["stored_len"])]
        if xxh3_64(stored) != int(entry["stored_xxh3"]):
            raise h.chunk_error(KvzCorruptError, r, f"checksum mismatch in {h.describe(r)}")
        if entry["flags"] & FLAG_STORED_RAW:
            return stored  # its checksum, just verified, is the raw checksum too
        spec = h.planes_for(int(entry["token_count"]))[int(entry["plane"])]
        try:
            raw = h.recipe.codec_for(spec.name).decode(stored, max_size=int(entry["raw_len"]))
        except (DecodeError, UsageError) as exc:
            raise h.chunk_error(KvzCorruptError, r, f"{h.describe(r)} does not decode: {exc}") from None
        if len(raw) != entry["raw_len"]:
            raise h.chunk_error(KvzCorruptError, r, f"{h.describe(r)} decodes to different bytes than were written")
        return raw


def _tensor_rows(shape: tuple[int, ...], position: int, start: int, tokens: int, row_bytes: int) -> np.ndarray:
    """Byte offsets of a block's rows (h, t) in a C-contiguous ``[n, heads, T, dim]`` array: tensor ``position``,
    token ``start + t``; -1 for the tokens outside ``0..T``."""
    _, heads, total, _ = shape
    t = start + np.arange(tokens, dtype=np.int64)
    offsets = ((position * heads + np.arange(heads, dtype=np.int64))[:, None] * total + t[None, :]) * row_bytes
    offsets[:, (t < 0) | (t >= total)] = -1
    return offsets.reshape(-1)
