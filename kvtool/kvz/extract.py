"""A .kvz (or part of one) written out as a safetensors cache, one decoded block at a time.

The file is the one ``reader.read(...).save(path)`` writes, byte for byte, but no
cache is ever in memory: the header is computed from the shapes, then each token
block is decoded and written at its place (one positioned write per head), so
memory stays at one block whatever the file's size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from kvtool.fileio import atomic_write
from kvtool.kvz.reader import KvzReader
from kvtool.safetensors_io import header_metadata, safetensors_frame, tensor_name
from kvtool.tokens import token_range


@dataclass(frozen=True)
class Extracted:
    """What was written: its layers, first token, token count and bytes of cache data."""

    layer_ids: list[int]
    token_start: int
    num_tokens: int
    nbytes: int


def extract_safetensors(
    reader: KvzReader,
    path: str | os.PathLike[str],
    layers: Sequence[int] | None = None,
    tokens: slice | None = None,
    provenance: dict[str, Any] | None = None,
    threads: int | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> Extracted:
    """Decode ``layers`` and a token range of ``reader`` into the safetensors file ``path`` (atomically);
    ``provenance`` replaces the file's own in the written header; blocks decode on ``threads`` workers
    (one per core by default), each writing its own rows."""
    start, stop = token_range(tokens, reader.num_tokens)
    wanted, positions = reader.selection(layers)
    reader.check_read_size(len(positions), stop - start)
    h = reader.header
    shape = (h.heads, stop - start, h.dim)
    names = [tensor_name(layer, kind) for layer in wanted for kind in ("k", "v")]
    metadata = header_metadata(h.dtype.name, h.model, dict(h.provenance if provenance is None else provenance), h.token_start + start)
    frame, starts = safetensors_frame([(name, shape, h.dtype.numpy) for name in names], metadata)
    row = h.dim * h.dtype.itemsize
    nbytes = len(names) * h.heads * (stop - start) * row
    with atomic_write(path) as f:
        f.write(frame)
        f.truncate(len(frame) + nbytes)
        fd = f.fileno()

        def write(tensor: int, token: int, block: np.ndarray) -> None:
            lo, hi = max(token, 0), min(token + block.shape[1], stop - start)
            if hi <= lo:
                return
            base = starts[names[tensor]]
            for head in range(h.heads):
                part = np.ascontiguousarray(block[head, lo - token : hi - token])
                at = base + (head * (stop - start) + lo) * row
                view = part.reshape(-1).view(np.uint8).data
                while len(view):
                    view = view[os.pwrite(fd, view, at) :]
                    at = base + (head * (stop - start) + hi) * row - len(view)

        reader.iter_blocks(write, wanted, slice(start, stop), threads, on_progress)
    return Extracted(list(wanted), h.token_start + start, stop - start, nbytes)
