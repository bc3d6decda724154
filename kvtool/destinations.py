"""Where a restore writes: the destinations a chunk pipeline decodes into, each owning how its bytes are addressed.

A pipeline (``kvtool.kvz.pipeline``) asks the destination, never its type, for
what its kernel can use, in this order:

``array()``
    the destination as one C-contiguous ``[n, heads, tokens, dim]`` array (the
    native batch then writes runs of tokens), or None;
``rows(positions, tokens, counts)``
    where each (head, token) row of a run of blocks goes: flat byte targets and
    an offset per row (engine pages, offload rows, another process's buffer), or
    None;
``view(position, token, count)``
    its own memory for one whole block, where a decoder may write directly;
``put(position, token, block)``
    a decoded ``[heads, count, dim]`` block, copied in: every destination takes it.

A destination with a decoder of its own for a recipe's stored chunks (GPU pages:
``kvtool.gpu.pages``) says so with ``takes_stored(recipe)``; the pipeline then
checks each chunk's stored checksum and hands it the chunks (``put_stored``)
instead of decoding them.

Blocks are addressed by ``position`` (which tensor of the read: K then V of each
layer asked for) and ``token`` (where the block's first token lands, counted
from the start of the read; negative when the read begins inside the block).
Rows outside the destination, or left out by it, get offset -1 and are not
written. Pure numpy: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from kvtool._native.batch import place_rows as native_place_rows
from kvtool.errors import UsageError


@dataclass(frozen=True)
class RowRun:
    """Where the rows of a run of blocks go, as the core's row-writing calls take them: row ``(h, t)`` of block
    ``i`` to byte ``rows[starts[i] + h * count_i + t]`` of ``targets[out_index[i]]``, nowhere where it is -1."""

    targets: Sequence[np.ndarray]  # flat writable uint8 arrays
    rows: np.ndarray  # int64
    starts: np.ndarray  # int64, one per block
    out_index: np.ndarray  # int64, one per block


@dataclass(frozen=True)
class StoredChunks:
    """An entry's stored chunks, checksums verified, for a destination that decodes them itself.

    Chunk ``i`` is ``data[offset[i]:offset[i] + length[i]]``: ``tokens[i]`` tokens of tensor ``position[i]``
    of the read, its first landing at ``token[i]``; ``stored_raw[i]`` where the container kept the values as
    they are. ``heads``, ``dim`` and ``dtype`` (kvtool's name) are the tensors'.
    """

    data: np.ndarray  # uint8
    position: np.ndarray
    token: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    tokens: np.ndarray
    stored_raw: np.ndarray  # bool
    heads: int
    dim: int
    dtype: str


class Destination:
    """Where decoded blocks go; subclasses say which of the ways in they offer (see the module docstring)."""

    def fit(self, n: int, heads: int, tokens: int, row_bytes: int) -> None:
        """Refuse (``UsageError``), before anything is decoded, a read of ``n`` tensors of ``heads`` x ``tokens`` rows of
        ``row_bytes`` bytes that this destination cannot hold."""

    def array(self) -> np.ndarray | None:
        return None

    def rows(self, positions: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> RowRun | None:
        return None

    def view(self, position: int, token: int, count: int) -> np.ndarray | None:
        return None

    def put(self, position: int, token: int, block: np.ndarray) -> None:
        raise NotImplementedError(f"{type(self).__name__} takes no decoded blocks")

    def takes_stored(self, recipe: Any) -> bool:
        """Whether this destination decodes ``recipe``'s stored chunks itself (``put_stored``)."""
        return False

    def put_stored(self, chunks: StoredChunks) -> None:
        raise NotImplementedError(f"{type(self).__name__} takes no stored chunks")


class Arena(Destination):
    """A preallocated C-contiguous ``[n, heads, tokens, dim]`` array: the cache a read returns is views of it."""

    def __init__(self, array: np.ndarray):
        if array.ndim != 4 or not array.flags.c_contiguous:
            raise UsageError("an arena is a C-contiguous [n, heads, tokens, dim] array")
        self._array = array

    def fit(self, n: int, heads: int, tokens: int, row_bytes: int) -> None:
        n_, heads_, tokens_, dim = self._array.shape
        if (n_, heads_, tokens_, dim * self._array.itemsize) != (n, heads, tokens, row_bytes):
            raise UsageError(f"the arena is {list(self._array.shape)}, the read needs [{n}, {heads}, {tokens}, *]")

    def array(self) -> np.ndarray:
        return self._array

    def view(self, position: int, token: int, count: int) -> np.ndarray | None:
        if token < 0 or token + count > self._array.shape[2]:
            return None
        view = self._array[position, :, token : token + count]
        return view if view.flags.c_contiguous else None

    def put(self, position: int, token: int, block: np.ndarray) -> None:
        start, stop = max(token, 0), min(token + block.shape[1], self._array.shape[2])
        self._array[position, :, start:stop] = block[:, start - token : stop - token]


class Rows(Destination):
    """Rows at byte offsets: row (h, t) of the read's tensor ``p`` goes to byte ``rows[p, h, t]`` of the flat byte array
    ``targets[target_of[p]]`` (-1: left out). Offsets are checked against their target before a byte is written."""

    def __init__(self, targets: Sequence[np.ndarray], rows: np.ndarray, target_of: Sequence[int]):
        self.targets = [t.reshape(-1).view(np.uint8) for t in targets]
        self.table = rows
        self.target_of = np.asarray(target_of, dtype=np.int64)

    def fit(self, n: int, heads: int, tokens: int, row_bytes: int) -> None:
        if self.table.shape != (n, heads, tokens) or len(self.target_of) != n:
            raise UsageError(f"rows must be [{n}, {heads}, {tokens}] offsets, one target per tensor")
        named = (self.target_of >= 0) & (self.target_of < len(self.targets))
        if not named.all():
            i = int(np.argmin(named))
            raise UsageError(f"tensor {i} names target {int(self.target_of[i])}, of {len(self.targets)}")
        sizes = np.array([t.size for t in self.targets], dtype=np.int64)
        if self.table.size and (self.table.reshape(n, -1).max(axis=1) > sizes[self.target_of] - row_bytes).any():
            raise UsageError("row offsets fall outside their target")

    def rows(self, positions: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> RowRun:
        positions = np.asarray(positions, dtype=np.int64)
        _, heads, length = self.table.shape
        if len(positions) and not np.any(tokens) and np.all(counts == length):  # whole tensors: one gather
            starts = np.arange(len(positions), dtype=np.int64) * (heads * length)
            in_order = len(positions) == len(self.table) and np.array_equal(positions, np.arange(len(positions)))
            rows = self.table.reshape(-1) if in_order else self.table[positions].reshape(-1)
            return RowRun(self.targets, rows, starts, self.target_of[positions])
        listed = [self.block_rows(int(p), int(t), int(n)) for p, t, n in zip(positions, tokens, counts)]
        starts = np.cumsum([0] + [len(r) for r in listed[:-1]]).astype(np.int64)
        rows = np.concatenate(listed) if listed else np.zeros(0, np.int64)
        return RowRun(self.targets, rows, starts, self.target_of[positions])

    def block_rows(self, position: int, token: int, count: int) -> np.ndarray:
        """The ``heads * count`` offsets of one block's rows, head-major; -1 outside the read."""
        table = self.table[position]
        tokens = table.shape[1]
        if 0 <= token and token + count <= tokens:
            offsets: np.ndarray = table[:, token : token + count].reshape(-1)
            return offsets
        inside = np.arange(token, token + count)
        clipped = np.clip(inside, 0, max(tokens - 1, 0))
        return np.where((inside >= 0) & (inside < tokens), table[:, clipped], -1).reshape(-1)

    def put(self, position: int, token: int, block: np.ndarray) -> None:
        flat = self.targets[int(self.target_of[position])]
        offsets = self.block_rows(position, token, block.shape[1])
        if not native_place_rows(block, offsets, flat):
            place_rows(flat, offsets, block.reshape(-1, block.shape[2]).view(np.uint8))


class PagedBlocks(Rows):
    """An engine's paged KV blocks: tensor ``p`` of the read is a ``[num_blocks, heads, block_size, dim]`` view at
    ``strides[p]`` (in elements, from element ``storage_offset[p]`` of ``targets[target_of[p]]``, elements of
    ``itemsize`` bytes); the read's tokens fill blocks ``block_ids`` in order, the first ``skip`` tokens left out."""

    def __init__(self, targets: Sequence[np.ndarray], target_of: Sequence[int], storage_offset: Sequence[int],
                 strides: Sequence[tuple[int, int, int]], heads: int, block_size: int, itemsize: int,
                 block_ids: Sequence[int], skip: int = 0):
        offsets = np.asarray(storage_offset, dtype=np.int64)[:, None, None] * itemsize
        groups = sorted(set(strides))  # K and V views of every layer usually share their strides: one group
        bases = np.stack([paged_rows(0, s, heads, block_size, block_ids) * itemsize for s in groups])
        table = (bases[0][None] if len(groups) == 1 else bases[[groups.index(s) for s in strides]]) + offsets
        table[:, :, :skip] = -1
        super().__init__(targets, table, target_of)


def paged_rows(storage_offset: int, strides: tuple[int, int, int], heads: int, block_size: int,
               block_ids: Sequence[int], skip: int = 0) -> np.ndarray:
    """Element offsets ``[heads, tokens]`` of each (head, token) row of a ``[num_blocks, heads, block_size, dim]`` view
    at ``strides`` (elements; the view starting at element ``storage_offset``) for tokens filling ``block_ids`` in
    order; the first ``skip`` tokens get -1 (left out)."""
    block_stride, head_stride, token_stride = strides
    tokens = len(block_ids) * block_size
    t = np.arange(tokens)
    ids = np.asarray(list(block_ids), dtype=np.int64)[t // block_size]
    rows = (storage_offset + ids[None, :] * block_stride + np.arange(heads)[:, None] * head_stride
            + (t % block_size)[None, :] * token_stride)
    rows[:, :skip] = -1
    return rows


class EachBlock(Destination):
    """A function handed each decoded block ``(position, token, [heads, count, dim])`` on the thread that decoded it
    (``verify --full``, streaming writers): memory stays at one block per thread."""

    def __init__(self, fn: Callable[[int, int, np.ndarray], None]):
        self._fn = fn

    def put(self, position: int, token: int, block: np.ndarray) -> None:
        self._fn(position, token, block)


def place_rows(flat: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> None:
    """Row ``i`` of ``rows`` to byte offset ``offsets[i]`` of ``flat``; a negative offset leaves it out.

    Offsets that are all whole rows apart (an engine's paged blocks are) move a
    row per index; others move a byte per index, eight times the memory.
    """
    kept = offsets >= 0
    if not kept.all():
        offsets, rows = offsets[kept], rows[kept]
    row_bytes = rows.shape[1]
    if row_bytes and not (offsets % row_bytes).any():
        flat[: flat.size // row_bytes * row_bytes].reshape(-1, row_bytes)[offsets // row_bytes] = rows
    else:
        flat[offsets[:, None] + np.arange(row_bytes)] = rows

