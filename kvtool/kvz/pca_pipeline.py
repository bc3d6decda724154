"""The lossy ``pca`` stage's batch pipeline: a run of blocks through zstd, then one native call into the destination.

Per run of about ``READ_RUN`` stored bytes: each block's plane has its stored
checksum checked, its zstd frame undone and its raw checksum checked (each
releases the GIL), then the core (``PcaBatchKernel``) decodes every block of
the run straight into the destination's rows, with the coder of each block's
tensor. The checks, their order and their messages are the per-chunk path's. A
destination with neither one array nor rows takes the per-chunk path.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvtool._native import xxh3_64
from kvtool._native.batch import Buffer, ChunkDecodeError
from kvtool._native.pca_batch import PcaBatchKernel
from kvtool.destinations import Destination
from kvtool.kvz.format import FLAG_STORED_RAW, KvzCorruptError
from kvtool.kvz.header import KvzHeader
from kvtool.kvz.pipeline import Blocks, PerChunk, checked_plane
from kvtool.kvz.sources import READ_RUN
from kvtool.layouts.pca import Pca


class PcaBatch(PerChunk):
    """``pca:...|zstd`` recipes: runs of blocks restored by the core, straight into the destination."""

    run_bytes = READ_RUN

    def __init__(self, header: KvzHeader, batch: PcaBatchKernel):
        super().__init__(header)
        self.batch = batch
        specs = header.planes_for(min(header.chunk_tokens, header.num_tokens)) if header.num_tokens else ()
        self._codec = header.recipe.codec_for(specs[0].name) if specs else header.recipe.codec
        self._models: list[Any] | None = None  # per manifest tensor: its coder in the core, looked up at the first read
        self._lock = threading.Lock()

    def _decode_run(self, data: Buffer, base: int, first: np.ndarray, tokens: np.ndarray, blocks: Blocks, lo: int,
                    destination: Destination) -> None:
        h = self.header
        models = self._coders()
        positions, starts = blocks.position[lo : lo + len(first)], blocks.token[lo : lo + len(first)]
        arena = destination.array()
        run = None if arena is not None else destination.rows(positions, starts, tokens)
        if models is None or (arena is None and run is None):
            super()._decode_run(data, base, first, tokens, blocks, lo, destination)
            return
        planes = [self._plane(data, base, int(r)) for r in first.tolist()]
        block_models = [models[int(t)] for t in blocks.tensor[lo : lo + len(first)].tolist()]
        if arena is not None:
            rows, row_start = _arena_rows(arena, positions, starts, tokens, h.heads)
            out_index, targets = np.zeros(len(first), np.int64), [arena.reshape(-1).view(np.uint8)]
        else:
            assert run is not None
            rows, row_start, out_index, targets = run.rows, run.starts, run.out_index, list(run.targets)
        try:
            self.batch.decode(planes, block_models, tokens, rows, row_start, out_index, targets)
        except ChunkDecodeError as exc:
            row = int(first[exc.job])
            raise h.chunk_error(KvzCorruptError, row, f"{h.describe(row)} {exc}") from None

    def _coders(self) -> list[Any] | None:
        """The core's coder of every manifest tensor (``MissingDictionaryError`` where the dictionary is not known,
        as on the per-chunk path), or None where one has none."""
        with self._lock:
            if self._models is None:
                h = self.header
                stages = [h.recipe.layouts.for_kind(kind, layer)[0] for layer, kind, _ in h.tensors]
                self._models = [stage.tensor().native if isinstance(stage, Pca) else None for stage in stages]
            return None if any(m is None for m in self._models) else self._models

    def _plane(self, data: Buffer, base: int, r: int) -> Buffer:
        """Index record ``r``'s plane, stored and raw checksums checked."""
        h = self.header
        entry = h.index[r]
        at = int(entry["offset"]) - base
        stored_raw = bool(entry["flags"] & FLAG_STORED_RAW)
        plane = checked_plane(h, self._codec, memoryview(data)[at : at + int(entry["stored_len"])], r, stored_raw)
        if not stored_raw and xxh3_64(plane) != int(entry["raw_xxh3"]):
            raise h.chunk_error(KvzCorruptError, r, f"{h.describe(r)} decodes to different bytes than were written")
        return plane


def _arena_rows(arena: np.ndarray, positions: np.ndarray, starts: np.ndarray, tokens: np.ndarray,
                heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte offsets of each block's (head, token) rows in a ``[n, heads, total, dim]`` arena (-1 outside the read),
    and where each block's offsets begin."""
    total, row_bytes = arena.shape[2], arena.shape[3] * arena.itemsize
    listed = []
    for p, s, n in zip(positions.tolist(), starts.tolist(), tokens.tolist()):
        t = np.arange(s, s + n)
        rows = ((p * heads + np.arange(heads))[:, None] * total + t[None, :]) * row_bytes
        listed.append(np.where((t >= 0) & (t < total), rows, -1).reshape(-1))
    row_start = np.cumsum([0] + [len(r) for r in listed[:-1]]).astype(np.int64)
    return (np.concatenate(listed) if listed else np.zeros(0, np.int64)), row_start
