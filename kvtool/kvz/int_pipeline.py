"""The lossy ``int`` stage's batch pipeline: a run of blocks through zstd, then one native call into the destination.

Per run of about ``READ_RUN`` stored bytes: each plane's stored checksum is
checked and its zstd frame decompressed (both release the GIL), then the core
(``IntBatchCodec``) checks every raw checksum and writes every block's values
straight into the destination, its rows computed here for each kind of
destination. The checks, their order and their messages are the per-chunk
path's; a run holding a block the core declines (non-finite scales, only in
crafted files) is decoded per chunk, by the numpy reference, as before. With
``codes=ctx`` each block's raw planes are checked here and its coded codes
decoded back to packed codes (``int_codes``, in C) before the core's call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtool._native import xxh3_64
from kvtool._native.batch import Buffer, ChunkDecodeError
from kvtool._native.int_batch import STRIDED, VERIFY_CODES, VERIFY_SCALES, Declined, IntBatchCodec, int_jobs
from kvtool.errors import DecodeError
from kvtool.kvz.format import FLAG_STORED_RAW, KvzCorruptError
from kvtool.kvz.header import KvzHeader
from kvtool.destinations import Destination
from kvtool.kvz.pipeline import Blocks, PerChunk, checked_plane
from kvtool.kvz.sources import READ_RUN
from kvtool.layouts import int_codes


class IntBatch(PerChunk):
    """``int:B,...|zstd`` recipes: runs of blocks restored by the core, straight into the destination."""

    run_bytes = READ_RUN

    def __init__(self, header: KvzHeader, batch: IntBatchCodec):
        super().__init__(header)
        self.batch = batch
        stages: list[Any] = [header.recipe.layouts.for_kind(kind, layer)[0] for layer, kind, _ in header.tensors]
        self._bits = np.array([stage.code_bits for stage in stages], np.uint8)  # per manifest tensor
        self._channel = np.array([stage.axis == "channel" for stage in stages], np.uint8)
        specs = header.planes_for(min(header.chunk_tokens, header.num_tokens)) if header.num_tokens else ()
        self._codecs = [header.recipe.codec_for(spec.name) for spec in specs]  # codes' and scales'
        self._coded = getattr(header.recipe.layouts[0], "codes", "packed") == "ctx"  # the codes plane holds coded codes, not packed ones

    def _decode_run(self, data: Buffer, base: int, first: np.ndarray, tokens: np.ndarray, blocks: Blocks, lo: int,
                    destination: Destination) -> None:
        h = self.header
        row_bytes = h.dim * h.dtype.itemsize
        positions, starts = blocks.position[lo : lo + len(first)], blocks.token[lo : lo + len(first)]
        arena = destination.array()
        run = None if arena is not None else destination.rows(positions, starts, tokens)
        if arena is None and run is None:  # a block at a time, through this thread's scratch
            for i in range(len(first)):
                n = int(tokens[i])
                block = self.scratch(n)
                jobs, planes = self._jobs(data, base, first[i : i + 1], tokens[i : i + 1], blocks, lo + i)
                jobs["flags"] |= STRIDED
                jobs["head_stride"], jobs["token_hi"] = n * row_bytes, n
                try:
                    self._restore(jobs, planes, first[i : i + 1], np.zeros(0, np.int64), [block.reshape(-1).view(np.uint8)])
                except Declined:
                    super()._decode_run(data, base, first[i : i + 1], tokens[i : i + 1], blocks, lo + i, destination)
                    continue
                destination.put(int(positions[i]), int(starts[i]), block)
            return
        jobs, planes = self._jobs(data, base, first, tokens, blocks, lo)
        if arena is not None:  # rows at strides: tensor `position`, tokens from `start`, clipped
            total = arena.shape[2]
            jobs["flags"] |= STRIDED
            jobs["row_start"] = (positions * h.heads * total + starts) * row_bytes
            jobs["head_stride"] = total * row_bytes
            jobs["token_lo"] = np.maximum(-starts, 0)
            jobs["token_hi"] = np.minimum(tokens, total - starts)
            targets, rows = [arena.reshape(-1).view(np.uint8)], np.zeros(0, np.int64)
        else:
            assert run is not None
            jobs["row_start"], jobs["out_index"] = run.starts, run.out_index
            targets, rows = list(run.targets), run.rows
        try:
            self._restore(jobs, planes, first, rows, targets)
        except Declined:  # the whole run again, per chunk: what the batch wrote is written again, the same
            super()._decode_run(data, base, first, tokens, blocks, lo, destination)

    def _jobs(self, data: Buffer, base: int, first: np.ndarray, tokens: np.ndarray, blocks: Blocks,
              lo: int) -> tuple[np.ndarray, list[Buffer]]:
        """The job records of blocks ``lo..`` (first index records ``first``; the destination's fields left for the
        caller) and their planes, codes then scales of each, checked and decompressed."""
        h = self.header
        view = memoryview(data)
        records = np.stack([first, first + 1], axis=1).reshape(-1)
        entries = h.index[records]
        raw = (entries["flags"] & FLAG_STORED_RAW) != 0
        planes = [
            checked_plane(h, self._codecs[plane], view[at : at + length], r, stored_raw)
            for r, plane, at, length, stored_raw in zip(
                records.tolist(), entries["plane"].tolist(), (entries["offset"].astype(np.int64) - base).tolist(),
                entries["stored_len"].tolist(), raw.tolist())
        ]
        tensor = blocks.tensor[lo : lo + len(first)]
        jobs = int_jobs(len(first))
        jobs["codes_xxh3"], jobs["scales_xxh3"] = entries["raw_xxh3"][0::2], entries["raw_xxh3"][1::2]
        jobs["block_tokens"] = tokens
        jobs["groups_per_head"] = [h.planes_for(n)[1].shape[1] for n in tokens.tolist()]
        jobs["bits"], jobs["channel_axis"] = self._bits[tensor], self._channel[tensor]
        jobs["flags"] = np.where(raw[0::2], 0, VERIFY_CODES) | np.where(raw[1::2], 0, VERIFY_SCALES)
        if self._coded:
            self._decode_codes(jobs, planes, records, entries)
        return jobs, planes

    def _decode_codes(self, jobs: np.ndarray, planes: list[Buffer], records: np.ndarray, entries: np.ndarray) -> None:
        """``codes=ctx``: each block's raw planes checked, as the core would, then its codes plane replaced by the
        packed codes it holds, which the core then reads as a ``packed`` recipe's."""
        h = self.header
        for i in range(len(jobs)):
            for k, flag in ((0, VERIFY_CODES), (1, VERIFY_SCALES)):
                r = int(records[2 * i + k])
                if jobs["flags"][i] & flag and xxh3_64(planes[2 * i + k]) != int(entries["raw_xxh3"][2 * i + k]):
                    raise h.chunk_error(KvzCorruptError, r, f"{h.describe(r)} decodes to different bytes than were written")
            shape = (h.heads, int(jobs["block_tokens"][i]), h.dim)
            try:
                planes[2 * i] = int_codes.decode(np.frombuffer(planes[2 * i], np.uint8), shape, int(jobs["bits"][i])).data
            except DecodeError as exc:
                r = int(records[2 * i])
                raise h.chunk_error(KvzCorruptError, r, f"{h.describe(r)} does not decode: {exc}") from None
        jobs["flags"] &= ~np.uint8(VERIFY_CODES | VERIFY_SCALES)

    def _restore(self, jobs: np.ndarray, planes: list[Buffer], first: np.ndarray, rows: np.ndarray,
                 targets: list[np.ndarray]) -> None:
        """The core restores the blocks of ``jobs`` from ``planes``; errors as the per-chunk path's."""
        h = self.header
        try:
            self.batch.decode(planes, jobs, rows, targets, h.heads, h.dim)
        except ChunkDecodeError as exc:
            row = int(first[exc.job])
            if exc.reason == "checksum":
                row += int(xxh3_64(planes[2 * exc.job]) == int(h.index[row]["raw_xxh3"]))  # the codes, or the scales
                raise h.chunk_error(KvzCorruptError, row, f"{h.describe(row)} decodes to different bytes than were written") from None
            raise h.chunk_error(KvzCorruptError, row, f"{h.describe(row)} {exc}") from None
