"""Reading a .kvz: open and validate (``KvzHeader``), select the chunks asked for, hand them to the pipeline."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from kvtool._native import xxh3_64
from kvtool._native.int_batch import IntBatchCodec
from kvtool._native.pca_batch import PcaBatchKernel
from kvtool.cache import KVCache
from kvtool.destinations import Arena, Destination, EachBlock, Rows
from kvtool.dtypes import DType
from kvtool.errors import UsageError
from kvtool.facts import ModelFacts
from kvtool.fileio import open_regular
from kvtool.kvz.format import (
    DEFAULT_MAX_EXPANSION, DEFAULT_MAX_SIZE, MAGIC, KvzCorruptError, KvzTooLargeError,
)
from kvtool.kvz.header import KvzHeader, Tensor, read_metadata
from kvtool.kvz.int_pipeline import IntBatch
from kvtool.kvz.pca_pipeline import PcaBatch
from kvtool.kvz.pipeline import Blocks, ChunkPipeline, NativeBatch, PerChunk
from kvtool.kvz.sources import Buffer, ByteSource, BytesSource, FileSource
from kvtool.layouts.base import PlaneSpec
from kvtool.recipe import Recipe
from kvtool.tokens import token_range

if TYPE_CHECKING:
    from typing_extensions import Self


class KvzReader:
    """A validated .kvz: header and index are read and checked on open; chunks on demand.

    Use ``open_kvz(path)`` or ``KvzReader.from_bytes(blob)``; then ``read()`` for a
    cache (optionally some layers and a token range), ``read_rows()`` into other
    memory, ``verify()`` to check every checksum.

    Every number in the header and index is checked against the file's size and
    fixed bounds before anything is computed from it. ``max_size`` caps what the
    reader decodes: a chunk whose declared size exceeds it is refused on open, a
    read whose result would exceed it before decoding. ``max_expansion`` caps how
    many times its stored size a coded chunk may decode to, checked for the chunks
    a read selects before anything is allocated for them, so a small file cannot
    make a reader allocate much more than its own size times that.

    Reading that runs out of memory (under a process memory limit, or a cache larger than
    the memory there is) ends in ``KvzTooLargeError``, as a read over ``max_size`` does,
    never in a raw ``MemoryError``.
    """

    def __init__(self, source: ByteSource, name: str = "<bytes>", max_size: int = DEFAULT_MAX_SIZE,
                 max_expansion: int = DEFAULT_MAX_EXPANSION):
        self._source = source
        self.name = name
        try:
            self._open(max_size, max_expansion)
        except MemoryError:
            source.close()
            raise _out_of_memory(name, "opening it") from None
        except BaseException:
            source.close()
            raise

    def _open(self, max_size: int, max_expansion: int) -> None:
        self.max_size = _limit(max_size, "max_size")
        self.max_expansion = _limit(max_expansion, "max_expansion", 1)
        self.header = KvzHeader.validate(read_metadata(self._source, self.name), self.name)
        largest = max((spec.nbytes for specs in self.header.block_planes.values() for spec in specs), default=0)
        if largest > self.max_size:
            raise KvzTooLargeError(f"{self.name}: a chunk would decode to {largest} bytes, over the limit of {self.max_size}")
        self._pipeline = pipeline_for(self.header)

    @classmethod
    def from_bytes(cls, data: Buffer, max_size: int = DEFAULT_MAX_SIZE, max_expansion: int = DEFAULT_MAX_EXPANSION) -> "KvzReader":
        return cls(BytesSource(data), max_size=max_size, max_expansion=max_expansion)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._source.close()

    # -- what the header says --------------------------------------------------------------------
    @property
    def bytes_read(self) -> int:
        """Bytes fetched from the file so far (header, index and chunks)."""
        return self._source.bytes_read

    @property
    def index(self) -> np.ndarray:
        return self.header.index

    @property
    def tensors(self) -> list[Tensor]:
        return list(self.header.tensors)

    @property
    def layer_ids(self) -> list[int]:
        return list(self.header.layer_ids)

    @property
    def recipe(self) -> Recipe:
        return self.header.recipe

    @property
    def dtype(self) -> DType:
        return self.header.dtype

    @property
    def model(self) -> ModelFacts:
        return self.header.model

    @property
    def chunk_tokens(self) -> int:
        return self.header.chunk_tokens

    @property
    def num_tokens(self) -> int:
        return self.header.num_tokens

    @property
    def token_start(self) -> int:
        return self.header.token_start

    @property
    def provenance(self) -> dict[str, Any]:
        return self.header.provenance

    @property
    def metadata(self) -> dict[str, str]:
        return self.header.metadata

    @property
    def lossy(self) -> dict[str, Any] | None:
        return self.header.lossy

    def planes_for(self, tokens: int) -> list[PlaneSpec]:
        """The recipe's planes for a block of ``tokens`` tokens."""
        return list(self.header.planes_for(tokens))

    # -- selecting chunks --------------------------------------------------------------------------
    def selection(self, layers: Sequence[int] | None) -> tuple[list[int], list[int]]:
        """The layer ids asked for, and the manifest tensors (K then V of each) they read."""
        if layers is None:
            return self.layer_ids, list(range(2 * len(self.header.layer_ids)))
        wanted = list(layers)
        where = {layer: i for i, layer in enumerate(self.header.layer_ids)}
        missing = [layer for layer in wanted if layer not in where]
        if missing:
            raise UsageError(f"{self.name}: no layers {missing} (it holds {self.layer_ids})")
        return wanted, [2 * where[layer] + kv for layer in wanted for kv in (0, 1)]

    def _blocks(self, tensors: Sequence[int], start: int, stop: int) -> Blocks:
        """The blocks of ``tensors`` that hold tokens ``start..stop``, in file order, after checking their
        chunks' expansion: nothing is allocated for a read until this passes."""
        first = start - start % self.chunk_tokens
        starts = np.arange(first, stop, self.chunk_tokens, dtype=np.int64)
        tensor = np.repeat(np.asarray(tensors, dtype=np.int64), len(starts))
        position = np.repeat(np.arange(len(tensors), dtype=np.int64), len(starts))
        block_start = np.tile(starts, len(tensors))
        order = np.argsort(tensor, kind="stable")  # manifest order is file order
        blocks = Blocks(tensor[order], block_start[order], position[order], block_start[order] - start)
        self._check_expansion(blocks)
        return blocks

    def _check_expansion(self, blocks: Blocks) -> None:
        """Refuse blocks whose planes would decode to more than ``max_expansion`` times their stored
        bytes, together: a single plane may shrink to almost nothing (the zero mantissas of
        ``mant-round:0``), a whole block of a real cache does not."""
        h = self.header
        first, _, planes = h.block_rows(blocks.tensor, blocks.start)
        if not len(first) or not planes.any():
            return
        rows = np.repeat(first, planes) + (np.arange(int(planes.sum())) - np.repeat(np.cumsum(planes) - planes, planes))
        starts = np.cumsum(planes) - planes
        raw = np.add.reduceat(h.index["raw_len"][rows].astype(np.float64), starts)
        stored = np.add.reduceat(h.index["stored_len"][rows].astype(np.float64), starts)
        over = raw > stored * float(self.max_expansion)
        if over.any():
            i = int(np.argmax(over))
            row = int(first[i])
            raise h.chunk_error(
                KvzTooLargeError, row,
                f"{h.describe(row)}: its block would expand {int(stored[i])} stored bytes to {int(raw[i])}, over "
                f"{self.max_expansion} times (raise max_expansion, --max-expansion, for a file you trust)",
            )

    def check_read_size(self, n_tensors: int, tokens: int) -> None:
        """Refuse, before anything is allocated, a read whose result would exceed ``max_size``."""
        nbytes = n_tensors * self.header.heads * tokens * self.header.dim * self.dtype.itemsize
        if nbytes > self.max_size:
            raise KvzTooLargeError(f"{self.name}: the cache read would be {nbytes} bytes, over the limit of {self.max_size}")

    def _decode(self, blocks: Blocks, destination: Destination, threads: int | None = None,
                on_progress: Callable[[int], None] | None = None) -> None:
        with self._memory_bounded("decoding it"):
            self._pipeline.decode(self._source, blocks, destination, threads, on_progress)

    @contextlib.contextmanager
    def _memory_bounded(self, doing: str) -> Iterator[None]:
        try:
            yield
        except MemoryError:
            raise _out_of_memory(self.name, doing) from None
        except RuntimeError as exc:  # a thread's stack is memory too; Python says so only in words
            if "can't start new thread" not in str(exc):
                raise
            raise _out_of_memory(self.name, "starting a decoding thread") from None

    # -- reading -------------------------------------------------------------------------------------
    def read(
        self,
        layers: Sequence[int] | None = None,
        tokens: slice | None = None,
        threads: int | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> KVCache:
        """Decode the cache, or only ``layers`` (model layer ids) and a token range, reading only their chunks.

        The tensors come back as views of one array, allocated once, into which every chunk decodes.
        """
        start, stop = token_range(tokens, self.num_tokens)
        self.check_read_size(2 * (len(self.layer_ids) if layers is None else len(layers)), stop - start)
        wanted, positions = self.selection(layers)
        blocks = self._blocks(positions, start, stop)
        h = self.header
        with self._memory_bounded(f"allocating {len(positions)} tensors of {stop - start} tokens"):
            arena = np.empty((len(positions), h.heads, stop - start, h.dim), self.dtype.numpy)
        self._decode(blocks, Arena(arena), threads, on_progress)
        tensors = list(arena)
        return KVCache(
            tensors[0::2], tensors[1::2], self.model, dict(self.provenance),
            layer_ids=list(wanted), token_start=self.token_start + start,
        )

    def read_rows(self, targets: list[np.ndarray], rows: np.ndarray, target_of: Sequence[int], layers: Sequence[int] | None = None) -> None:
        """Decode ``layers`` (all by default) into other memory, row by row: row (head h, token t) of the
        i-th tensor read (K then V of each layer) goes to byte offset ``rows[i, h, t]`` of the flat byte
        array ``targets[target_of[i]]``; a negative offset leaves that row out (``kvtool.destinations.Rows``).

        For destinations laid out otherwise than ``[heads, tokens, dim]``, such as an engine's paged
        KV blocks: each chunk goes from the stored bytes to its rows, through at most one block-sized
        buffer, with no intermediate cache. Offsets are checked against the targets before a byte is
        written.
        """
        self.read_into(Rows(targets, rows, target_of), layers)

    def read_into(self, destination: Destination, layers: Sequence[int] | None = None, tokens: slice | None = None,
                  threads: int | None = 1) -> None:
        """Decode ``layers`` (all by default) and a token range into ``destination``, which first says whether it can
        hold them (``Destination.fit``): the one way a restore writes into memory it does not own."""
        start, stop = token_range(tokens, self.num_tokens)
        _, positions = self.selection(layers)
        h = self.header
        try:
            destination.fit(len(positions), h.heads, stop - start, h.dim * self.dtype.itemsize)
        except UsageError as exc:
            raise UsageError(f"{self.name}: {exc}") from None
        self._decode(self._blocks(positions, start, stop), destination, threads)

    def iter_blocks(self, fn: Callable[[int, int, np.ndarray], None], layers: Sequence[int] | None = None,
                    tokens: slice | None = None, threads: int | None = 1,
                    on_progress: Callable[[int], None] | None = None) -> None:
        """Decode the blocks of ``layers`` and a token range, handing each to ``fn(tensor, token, block)``
        on the thread that decoded it (``threads`` workers; one by default): the tensor's position in
        the read (K then V of each layer), its first token counted from the range's start (negative
        when the range begins inside it), and a ``[heads, tokens, dim]`` array valid during the call.
        Memory stays at a block per thread whatever the file's size: how a writer streams a cache."""
        start, stop = token_range(tokens, self.num_tokens)
        _, positions = self.selection(layers)
        self._decode(self._blocks(positions, start, stop), EachBlock(fn), threads, on_progress)

    def verify(self, full: bool = False, on_progress: Callable[[int], None] | None = None) -> None:
        """Check every chunk's checksum; with ``full``, also decode every chunk exactly as a read does
        (the same pipeline, the same checks), one block at a time, and check its raw checksum."""
        if full:
            self.iter_blocks(_discard, on_progress=on_progress)
            return
        for row, entry in enumerate(self.index):
            stored = self._source.read(int(entry["offset"]), int(entry["stored_len"]))
            if xxh3_64(stored) != int(entry["stored_xxh3"]):
                raise self.header.chunk_error(KvzCorruptError, row, f"checksum mismatch in chunk {row}")
            if on_progress:
                on_progress(int(entry["raw_len"]))

    def sizes(self) -> dict[str, Any]:
        """Raw and stored bytes per layer, per K/V and per plane, from the index alone."""
        raw = self.index["raw_len"].astype(np.int64)
        stored = self.index["stored_len"].astype(np.int64)
        specs = self.planes_for(min(self.chunk_tokens, self.num_tokens)) if self.num_tokens else []
        names = [s.name for s in specs]

        def group(keys: Iterable[Any]) -> dict[Any, dict[str, Any]]:
            out: dict[Any, list[int]] = {}
            for key, r, s in zip(keys, raw, stored):
                entry = out.setdefault(key, [0, 0])
                entry[0] += int(r)
                entry[1] += int(s)
            return {k: {"raw": r, "stored": s, "ratio": r / s if s else 1.0} for k, (r, s) in out.items()}

        return {
            "total": group(["all"] * len(raw))["all"] if len(raw) else {"raw": 0, "stored": 0, "ratio": 1.0},
            "by_kind": group(self.header.tensors[t][1] for t in self.index["tensor"]),
            "by_layer": group(self.header.tensors[t][0] for t in self.index["tensor"]),
            "by_plane": group(names[p] for p in self.index["plane"]),
        }


def pipeline_for(header: KvzHeader) -> ChunkPipeline:
    """The native batch where the recipe's stages offer one on this dtype (a codec's batch kernel, or the ``int`` or
    ``pca`` stage's over zstd planes), else per chunk."""
    dtype = header.dtype.numpy
    batch = header.recipe.batch_kernel(dtype)
    if batch is not None:
        return NativeBatch(header, batch)
    stage = header.recipe.stage_kernel(dtype)
    if isinstance(stage, IntBatchCodec):
        return IntBatch(header, stage)
    if isinstance(stage, PcaBatchKernel):
        return PcaBatch(header, stage)
    return PerChunk(header)


def _discard(tensor: int, token: int, block: np.ndarray) -> None:
    """Each block decoded, checked and dropped: what ``verify(full=True)`` asks for."""


def _out_of_memory(name: str, doing: str) -> KvzTooLargeError:
    return KvzTooLargeError(f"{name}: out of memory {doing} (fewer layers or tokens, fewer threads, "
                            "or more memory may fit)")


def _limit(value: object, what: str, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UsageError(f"{what} must be a whole number of at least {least}, not {value!r}")
    return value


def open_kvz(path: str | os.PathLike[str], max_size: int = DEFAULT_MAX_SIZE, max_expansion: int = DEFAULT_MAX_EXPANSION) -> KvzReader:
    """Open and validate a .kvz file (header, index, trailer); chunks are read on demand.

    ``max_size`` and ``max_expansion`` cap what the reader decodes (see ``KvzReader``).
    """
    return KvzReader(FileSource(path), name=os.fspath(path), max_size=max_size, max_expansion=max_expansion)


def decode_cache(
    data: Buffer,
    layers: Sequence[int] | None = None,
    tokens: slice | None = None,
    max_size: int = DEFAULT_MAX_SIZE,
    max_expansion: int = DEFAULT_MAX_EXPANSION,
) -> KVCache:
    """The cache held in .kvz bytes (all of it, or some layers and tokens), at most ``max_size`` bytes of it."""
    with KvzReader.from_bytes(data, max_size=max_size, max_expansion=max_expansion) as reader:
        return reader.read(layers=layers, tokens=tokens)


def is_kvz(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` starts with the .kvz magic; refuses a path that is not a regular file."""
    with open_regular(path) as f:
        return f.read(len(MAGIC)) == MAGIC
