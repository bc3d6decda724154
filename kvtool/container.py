"""The ``.kvz`` container: a KV cache cut into checksummed, compressed chunks.

Layout of a file (all integers little-endian; docs/FORMAT.md is the reference)::

    preamble   magic (8) | version u32 | header length u32
    header     JSON: recipe, tensor manifest, model facts, provenance, metadata
    chunks     one per (tensor, token block, plane), back to back
    index      one 56-byte record per chunk
    trailer    64 bytes: index offset and length, chunk count, header length,
               xxh3-64 of header, index and trailer; end magic

A writer streams (header first, index last); a reader seeks to the trailer,
checks every size before it allocates, and reads only the chunks it needs.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterable, Iterator, Sequence

import numpy as np
import xxhash

from kvtool._native import JOB_DTYPE, JOB_STORED_RAW, xxh3_64
from kvtool._native.batch import BatchCodec
from kvtool.cache import KVCache
from kvtool.dtypes import dtype_of
from kvtool.errors import DecodeError, KvtoolError, OutputTooLargeError, UsageError
from kvtool.facts import AXES, ModelFacts
from kvtool.fileio import atomic_write, open_regular
from kvtool.layouts.base import PlaneSpec
from kvtool.layouts.lossy import ErrorTally
from kvtool.recipe import DEFAULT_RECIPE, Recipe
from kvtool.tokens import token_range

if TYPE_CHECKING:
    from typing_extensions import Self

MAGIC = b"\x89KVZ\r\n\x1a\n"
END_MAGIC = b"KVZ-END\n"
VERSION = 1
PREAMBLE = struct.Struct("<8sII")
TRAILER = struct.Struct("<QQQQQQQ8s")
MAX_HEADER = 16 << 20
MAX_CHUNK_TOKENS = 1 << 20
DEFAULT_CHUNK_TOKENS = 256
FLAG_STORED_RAW = 1
#: Bounds a reader checks before it computes with a header's numbers.
MAX_TOKENS = (1 << 32) - 1  # an index record holds token positions as u32
MAX_TOKEN_START = (1 << 63) - 1
MAX_LAYER_ID = (1 << 31) - 1
MAX_ROW_BYTES = 1 << 30  # heads x head_dim x itemsize of one token of one tensor
MAX_JSON_DEPTH = 32
#: What a reader decodes at most unless told otherwise (``max_size``; CLI ``--max-size``).
DEFAULT_MAX_SIZE = 16 << 30

INDEX_DTYPE = np.dtype(
    [
        ("tensor", "<u4"),  # position in the header's tensor manifest
        ("plane", "<u2"),  # position in the recipe's plane list
        ("flags", "<u2"),  # FLAG_STORED_RAW: bytes stored without the codec
        ("token_start", "<u4"),
        ("token_count", "<u4"),
        ("offset", "<u8"),  # from the start of the file
        ("stored_len", "<u8"),
        ("raw_len", "<u8"),
        ("stored_xxh3", "<u8"),  # of the bytes as stored
        ("raw_xxh3", "<u8"),  # of the plane's bytes before compression
    ]
)
assert INDEX_DTYPE.itemsize == 56


#: The batch read path fetches chunks in runs of about this many stored bytes.
READ_RUN = 4 << 20


def _runs(jobs: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Split jobs sorted by offset into ``(lo, hi)`` runs of adjacent chunks of about ``limit`` bytes."""
    runs, lo, size = [], 0, 0
    for i in range(len(jobs)):
        adjacent = i == lo or jobs["offset"][i] == jobs["offset"][i - 1] + jobs["stored_len"][i - 1]
        if not adjacent or (size and size + int(jobs["stored_len"][i]) > limit):
            runs.append((lo, i))
            lo, size = i, 0
        size += int(jobs["stored_len"][i])
    if len(jobs):
        runs.append((lo, len(jobs)))
    return runs


class KvzFormatError(DecodeError):
    """Not a .kvz file, an unsupported version, or a header that breaks the format's rules."""


class KvzCorruptError(DecodeError):
    """A checksum mismatch, a truncation, or sizes that do not add up."""


# -- writing --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Block:
    tensor: int
    token_start: int
    array: np.ndarray


def write_cache(
    out: BinaryIO,
    cache: KVCache,
    recipe: Recipe | str = DEFAULT_RECIPE,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    threads: int | None = None,
    metadata: dict[str, str] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> int:
    """Stream ``cache`` as a .kvz into ``out``; return the bytes written.

    Token blocks are transformed and compressed on ``threads`` workers (all
    cores by default) while at most a few blocks per worker are in flight.
    ``on_progress`` receives the raw bytes of each finished block.
    """
    recipe = Recipe.parse(recipe) if isinstance(recipe, str) else recipe
    if not 1 <= chunk_tokens <= MAX_CHUNK_TOKENS:
        raise UsageError(f"chunk tokens must be in 1..{MAX_CHUNK_TOKENS}, not {chunk_tokens}")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise UsageError("user metadata must map strings to strings")
    tensors = list(cache.tensors())
    if tensors:
        recipe.plan(PlaneSpec.of(tensors[0][2][:, :1]))  # fail early on a recipe that does not fit the dtype
    records: list[tuple] = []
    if recipe.lossy:
        # The header carries the error each tensor's round trip cost, known once every block is
        # encoded: the chunks wait in memory (a fraction of the cache) and follow the header.
        tally = ErrorTally(tensors)
        body = io.BytesIO()
        _write_blocks(body, tensors, recipe, chunk_tokens, threads, 0, records, on_progress, tally)
        header = _header_bytes(cache, recipe, chunk_tokens, metadata or {}, tally.rows())
        offset = PREAMBLE.size + len(header)
        records = [r[:5] + (r[5] + offset,) + r[6:] for r in records]
        out.write(PREAMBLE.pack(MAGIC, VERSION, len(header)))
        out.write(header)
        out.write(body.getbuffer())
        offset += body.tell()
    else:
        header = _header_bytes(cache, recipe, chunk_tokens, metadata or {})
        out.write(PREAMBLE.pack(MAGIC, VERSION, len(header)))
        out.write(header)
        offset = PREAMBLE.size + len(header)
        batch = BatchCodec.for_recipe(recipe, cache.dtype.numpy)
        if batch is not None:
            offset = _write_tensors(out, tensors, batch, chunk_tokens, threads, offset, records, on_progress)
        else:
            offset = _write_blocks(out, tensors, recipe, chunk_tokens, threads, offset, records, on_progress)
    index = np.array(records, dtype=INDEX_DTYPE).tobytes()
    out.write(index)
    fields = (offset, len(index), len(records), len(header), xxhash.xxh3_64_intdigest(header), xxhash.xxh3_64_intdigest(index))
    out.write(TRAILER.pack(*fields, _trailer_hash(fields), END_MAGIC))
    return offset + len(index) + TRAILER.size


def _write_blocks(out, tensors, recipe: Recipe, chunk_tokens: int, threads, offset: int, records: list, on_progress,
                  tally: ErrorTally | None = None) -> int:
    """The per-chunk path: any recipe, one block at a time through its layouts and codecs; a lossy
    recipe's round trip error goes to ``tally``."""
    blocks = (
        _Block(i, start, array[:, start : start + chunk_tokens])
        for i, (_, _, array) in enumerate(tensors)
        for start in range(0, array.shape[1], chunk_tokens)
    )

    def encode(block: _Block) -> tuple[list, Any]:
        return _encode_block(block, recipe.for_kind(tensors[block.tensor][1]), tally is not None)

    for block, (chunks, error) in _map_bounded(encode, blocks, threads):
        if tally is not None:
            tally.add(block.tensor, error)
        for plane, (flags, raw_len, raw_hash, stored_hash, stored) in enumerate(chunks):
            out.write(stored)
            records.append(
                (block.tensor, plane, flags, block.token_start, block.array.shape[1], offset,
                 len(stored), raw_len, stored_hash, raw_hash)
            )
            offset += len(stored)
        if on_progress:
            on_progress(block.array.nbytes)
    return offset


def _write_tensors(out, tensors, batch: BatchCodec, chunk_tokens: int, threads, offset: int, records: list, on_progress) -> int:
    """The batch path: each tensor's blocks cut and coded in one native call, tensors on a thread pool."""
    jobs = ((i, array) for i, (_, _, array) in enumerate(tensors))
    for (i, array), (blob, meta) in _map_bounded(lambda job: batch.encode_tensor(job[1], chunk_tokens), jobs, threads):
        out.write(blob)
        for k, m in enumerate(meta):
            start = k * chunk_tokens
            records.append(
                (i, 0, int(m["flags"]) and FLAG_STORED_RAW, start, min(chunk_tokens, array.shape[1] - start), offset,
                 int(m["stored_len"]), int(m["raw_len"]), int(m["stored_xxh3"]), int(m["raw_xxh3"]))
            )
            offset += int(m["stored_len"])
        if on_progress:
            on_progress(array.nbytes)
    return offset


def _encode_block(block: _Block, recipe: Recipe, measure: bool = False) -> tuple[list[tuple[int, int, int, int, bytes | memoryview]], Any]:
    """``(flags, raw length, raw hash, stored hash, stored bytes)`` for each plane of a block; with
    ``measure``, also what the round trip through the layouts costs it (``ErrorTally.block``)."""
    planes = recipe.layouts.forward([block.array])
    error = None
    if measure:
        (approx,) = recipe.layouts.inverse(planes, [PlaneSpec.of(block.array)])
        error = ErrorTally.block(block.array, approx)
    if recipe.array_codec is not None:
        stored_planes = [recipe.array_codec.encode_array(planes[0])]
    else:
        specs = recipe.plan(PlaneSpec.of(block.array))
        stored_planes = [recipe.codec_for(spec.name).encode(_plane_bytes(p)) for spec, p in zip(specs, planes)]
    out: list[tuple[int, int, int, int, bytes | memoryview]] = []
    for plane, stored in zip(planes, stored_planes):
        raw = _plane_bytes(plane)
        raw_hash = xxh3_64(raw)
        if len(stored) >= len(raw):
            out.append((FLAG_STORED_RAW, len(raw), raw_hash, raw_hash, raw))
        else:
            out.append((0, len(raw), raw_hash, xxh3_64(stored), stored))
    return out, error


def _plane_bytes(plane: np.ndarray) -> memoryview:
    return np.ascontiguousarray(plane).reshape(-1).view(np.uint8).data


def _map_bounded(fn, items: Iterable, threads: int | None) -> Iterator[tuple[Any, Any]]:
    """``(item, fn(item))`` in order, computed on a pool with a bounded number in flight."""
    if threads is not None and (type(threads) is not int or threads < 0):
        raise UsageError(f"threads must be a whole number, 0 or None for one per core, not {threads!r}")
    workers = threads or os.cpu_count() or 1
    if workers == 1:
        for item in items:
            yield item, fn(item)
        return
    with ThreadPoolExecutor(workers) as pool:
        pending: list = []
        for item in items:
            pending.append((item, pool.submit(fn, item)))
            if len(pending) >= 4 * workers:
                first, future = pending.pop(0)
                yield first, future.result()
        for item, future in pending:
            yield item, future.result()


def _header_bytes(cache: KVCache, recipe: Recipe, chunk_tokens: int, metadata: dict[str, str],
                  error: list[dict[str, Any]] | None = None) -> bytes:
    header = {
        "format": "kvz",
        "version": VERSION,
        "recipe": recipe.to_config(),
        "chunk_tokens": chunk_tokens,
        "dtype": cache.dtype.name,
        "axes": list(AXES),
        "token_start": cache.token_start,
        "tensors": [{"layer": layer, "kind": kind, "shape": list(a.shape)} for layer, kind, a in cache.tensors()],
        "model": cache.model.to_dict(),
        "provenance": cache.provenance,
        "metadata": metadata,
    }
    if error is not None:  # the lossy marker, and what the approximation costs each tensor
        header["lossy"] = {"error": error}
    if _depth(header) > MAX_JSON_DEPTH:
        raise UsageError(f"provenance is nested deeper than a .kvz header allows ({MAX_JSON_DEPTH} levels)")
    try:
        data = json.dumps(header, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    except ValueError as exc:
        raise UsageError(f"provenance holds a value JSON cannot carry: {exc}") from None
    if len(data) > MAX_HEADER:
        raise UsageError(f"the header would be {len(data)} bytes, over the {MAX_HEADER}-byte limit")
    return data


def _trailer_hash(fields: Sequence[int]) -> int:
    return xxhash.xxh3_64_intdigest(struct.pack("<6Q", *fields))


def save(
    cache: KVCache,
    path: str | os.PathLike,
    recipe: Recipe | str = DEFAULT_RECIPE,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    threads: int | None = None,
    metadata: dict[str, str] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> int:
    """Write ``cache`` to a .kvz file atomically; return its size in bytes."""
    with atomic_write(path) as f:
        return write_cache(f, cache, recipe, chunk_tokens, threads, metadata, on_progress)


def encode_cache(cache: KVCache, recipe: Recipe | str = DEFAULT_RECIPE, **kwargs) -> bytes:
    """The .kvz bytes of ``cache``, for stores and network transfers."""
    buf = io.BytesIO()
    write_cache(buf, cache, recipe, **kwargs)
    return buf.getvalue()


# -- reading --------------------------------------------------------------------------------


class _FileSource:
    """Positioned reads from a file, counting what was read."""

    def __init__(self, path: Path):
        self._f = open_regular(path)
        self.size = os.fstat(self._f.fileno()).st_size
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._buffers = threading.local()

    def read(self, offset: int, length: int) -> bytes:
        data = os.pread(self._f.fileno(), length, offset)
        with self._lock:
            self.bytes_read += len(data)
        if len(data) != length:
            raise KvzCorruptError(f"file ends early: wanted {length} bytes at {offset}, got {len(data)}")
        return data

    def read_run(self, offset: int, length: int) -> memoryview:
        """Like ``read``, into a buffer this thread reuses (valid until its next ``read_run``):
        a fresh buffer per run would cost a page fault per 4 KiB."""
        buf = getattr(self._buffers, "buf", None)
        if buf is None or len(buf) < length:
            buf = self._buffers.buf = bytearray(max(length, READ_RUN))
        view = memoryview(buf)[:length]
        got = os.preadv(self._f.fileno(), [view], offset)
        with self._lock:
            self.bytes_read += got
        if got != length:
            raise KvzCorruptError(f"file ends early: wanted {length} bytes at {offset}, got {got}")
        return view

    def close(self) -> None:
        self._f.close()


class _BytesSource:
    def __init__(self, data: bytes | bytearray | memoryview):
        self._data = memoryview(data).cast("B")
        self.size = len(self._data)
        self.bytes_read = 0

    def read(self, offset: int, length: int) -> memoryview:
        self.bytes_read += length
        return self._data[offset : offset + length]

    read_run = read

    def close(self) -> None:
        self._data.release()


class KvzReader:
    """A validated .kvz: header and index are read and checked on open; chunks on demand.

    Use ``open_kvz(path)`` or ``KvzReader.from_bytes(blob)``; then ``read()``
    for a cache (optionally some layers and a token range), ``verify()`` to
    check every checksum.

    Every number in the header and index is checked against the file's size
    and fixed bounds before anything is computed from it, so a crafted file
    costs work in proportion to its own size. ``max_size`` caps what the reader
    decodes: a chunk whose declared size exceeds it is refused on open, and a
    ``read()`` whose result would exceed it is refused before decoding.
    """

    def __init__(self, source, name: str = "<bytes>", max_size: int = DEFAULT_MAX_SIZE):
        self._source = source
        self.name = name
        try:
            if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 0:
                raise UsageError(f"max_size must be a number of bytes, not {max_size!r}")
            self.max_size = max_size
            self._load()
        except BaseException:
            source.close()
            raise

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, max_size: int = DEFAULT_MAX_SIZE) -> "KvzReader":
        return cls(_BytesSource(data), max_size=max_size)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._source.close()

    @property
    def bytes_read(self) -> int:
        """Bytes fetched from the file so far (header, index and chunks)."""
        return self._source.bytes_read

    # -- validation on open -----------------------------------------------------------------
    def _fail(self, cls, message: str):
        raise cls(f"{self.name}: {message}")

    def _load(self) -> None:
        src = self._source
        if src.size < PREAMBLE.size + TRAILER.size:
            if src.size >= 8 and bytes(src.read(0, 8)) != MAGIC:
                self._fail(KvzFormatError, "not a .kvz file")
            self._fail(KvzCorruptError, f"truncated: only {src.size} bytes")
        magic, version, header_len = PREAMBLE.unpack(src.read(0, PREAMBLE.size))
        if magic != MAGIC:
            self._fail(KvzFormatError, "not a .kvz file (bad magic)")
        if version != VERSION:
            self._fail(KvzFormatError, f"format version {version} is not supported (this kvtool reads version {VERSION})")
        *fields, trailer_hash, end = TRAILER.unpack(src.read(src.size - TRAILER.size, TRAILER.size))
        if end != END_MAGIC or trailer_hash != _trailer_hash(fields):
            self._fail(KvzCorruptError, "the trailer is damaged or missing (truncated or corrupt file)")
        # struct gives Python ints: none of the sums below can wrap around.
        index_offset, index_len, n_chunks, trailer_header_len, header_hash, index_hash = fields
        if trailer_header_len != header_len or header_len > MAX_HEADER:
            self._fail(KvzCorruptError, f"header length {header_len} disagrees with the trailer or exceeds {MAX_HEADER}")
        data_start = PREAMBLE.size + header_len
        if index_len != n_chunks * INDEX_DTYPE.itemsize or index_offset < data_start:
            self._fail(KvzCorruptError, "index size or position is inconsistent")
        if index_offset + index_len + TRAILER.size != src.size:
            self._fail(KvzCorruptError, "the file length does not match the trailer (trailing or missing bytes)")
        header_bytes = bytes(src.read(PREAMBLE.size, header_len))
        if xxhash.xxh3_64_intdigest(header_bytes) != header_hash:
            self._fail(KvzCorruptError, "header checksum mismatch")
        index_bytes = bytes(src.read(index_offset, index_len))
        if xxhash.xxh3_64_intdigest(index_bytes) != index_hash:
            self._fail(KvzCorruptError, "index checksum mismatch")
        self._parse_header(self._header_json(header_bytes))
        self.index = np.frombuffer(index_bytes, dtype=INDEX_DTYPE)
        self._check_index(data_start, index_offset)

    def _header_json(self, data: bytes) -> dict[str, Any]:
        """The header as a JSON object of bounded depth holding only finite numbers."""
        try:
            header = json.loads(data, parse_constant=_no_constant, parse_float=_finite_float)
        except RecursionError:
            self._fail(KvzFormatError, f"header nests deeper than {MAX_JSON_DEPTH} levels")
        except ValueError as exc:
            self._fail(KvzFormatError, f"header is not valid JSON ({str(exc)[:200]})")
        if not isinstance(header, dict):
            self._fail(KvzFormatError, "header is not a JSON object")
        if _depth(header) > MAX_JSON_DEPTH:
            self._fail(KvzFormatError, f"header nests deeper than {MAX_JSON_DEPTH} levels")
        return header

    def _parse_header(self, header: dict[str, Any]) -> None:
        if header.get("format") != "kvz" or header.get("version") != VERSION:
            self._fail(KvzFormatError, "header does not describe a version-1 .kvz")
        if header.get("axes") != list(AXES):
            self._fail(KvzFormatError, f"unsupported axes {_brief(header.get('axes'))}")
        self.chunk_tokens = self._int(header.get("chunk_tokens"), "chunk_tokens", 1, MAX_CHUNK_TOKENS)
        self.token_start = self._int(header.get("token_start"), "token_start", 0, MAX_TOKEN_START)
        self.tensors = [self._tensor(t) for t in self._typed(header.get("tensors"), list, "tensors")]
        self.provenance = dict(self._typed(header.get("provenance"), dict, "provenance"))
        metadata = self._typed(header.get("metadata", {}), dict, "metadata")
        if not all(isinstance(v, str) for v in metadata.values()):
            self._fail(KvzFormatError, "user metadata must map strings to strings")
        self.metadata = dict(metadata)
        try:
            self.dtype = dtype_of(self._typed(header.get("dtype"), str, "dtype"))
            self.model = ModelFacts.from_dict(self._typed(header.get("model"), dict, "model"))
            self.recipe = Recipe.from_config(header.get("recipe"))
        except DecodeError:
            raise
        except KvtoolError as exc:
            self._fail(KvzFormatError, f"header names something this kvtool cannot rebuild: {exc}")
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            self._fail(KvzFormatError, f"malformed header ({type(exc).__name__}: {str(exc)[:200]})")
        self._validate_manifest()
        self.lossy = self._lossy_marker(header.get("lossy"))

    def _lossy_marker(self, marker: Any) -> dict[str, Any] | None:
        """The header's ``lossy`` object: there exactly when the recipe has a lossy stage."""
        if marker is None and not self.recipe.lossy:
            return None
        if not self.recipe.lossy or not isinstance(marker, dict) or not isinstance(marker.get("error"), list):
            self._fail(KvzFormatError, f"the 'lossy' marker must be present exactly when the recipe is lossy ({self.recipe.spec()!r})")
        for row in marker["error"]:
            if not isinstance(row, dict) or not all(type(row.get(k)) in (int, float) for k in ("layer", "max_abs", "rms", "rel_rms")):
                self._fail(KvzFormatError, "the 'lossy' marker's error rows need a layer, max_abs, rms and rel_rms")
        return marker

    def _int(self, value: Any, what: str, lo: int, hi: int) -> int:
        if type(value) is not int or not lo <= value <= hi:
            self._fail(KvzFormatError, f"{what} must be an integer in {lo}..{hi}, not {_brief(value)}")
        return value

    def _typed(self, value: Any, kind: type, what: str) -> Any:
        if not isinstance(value, kind):
            self._fail(KvzFormatError, f"{what} must be a JSON {'object' if kind is dict else kind.__name__}, not {_brief(value)}")
        return value

    def _tensor(self, entry: Any) -> tuple[int, str, tuple[int, int, int]]:
        entry = self._typed(entry, dict, "a tensor entry")
        shape = self._typed(entry.get("shape"), list, "a tensor shape")
        if len(shape) != 3 or entry.get("kind") not in ("k", "v"):
            self._fail(KvzFormatError, f"a tensor entry needs kind 'k' or 'v' and a [heads, tokens, dim] shape, not {_brief(entry)}")
        heads, tokens, dim = (self._int(n, "a tensor dimension", 0, bound) for n, bound in zip(shape, (MAX_ROW_BYTES, MAX_TOKENS, MAX_ROW_BYTES)))
        return self._int(entry.get("layer"), "a layer id", 0, MAX_LAYER_ID), entry["kind"], (heads, tokens, dim)

    def _validate_manifest(self) -> None:
        if not self.tensors:
            self.num_tokens = 0
            self.layer_ids: list[int] = []
            self._heads = self._dim = 0
            self._planes_by_len: dict[int, list[PlaneSpec]] = {}
            return
        shapes = {shape for _, _, shape in self.tensors}
        if len(shapes) != 1:
            self._fail(KvzFormatError, f"tensor shapes must be one shared [heads, tokens, dim], found {len(shapes)} different ones")
        heads, self.num_tokens, dim = next(iter(shapes))
        if heads * dim * self.dtype.itemsize > MAX_ROW_BYTES:
            self._fail(KvzFormatError, "tensor rows are implausibly large")
        kinds = [kind for _, kind, _ in self.tensors]
        self.layer_ids = [layer for layer, kind, _ in self.tensors if kind == "k"]
        if kinds != ["k", "v"] * len(self.layer_ids) or [l for l, _, _ in self.tensors][1::2] != self.layer_ids:
            self._fail(KvzFormatError, "the tensor manifest must list K then V for each layer")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            self._fail(KvzFormatError, "a layer appears twice in the manifest")
        self._heads, self._dim = heads, dim
        self._planes_by_len = {}

    def planes_for(self, tokens: int) -> list[PlaneSpec]:
        """The recipe's planes for a block of ``tokens`` tokens."""
        if tokens not in self._planes_by_len:
            block = PlaneSpec("data", (self._heads, tokens, self._dim), self.dtype.numpy)
            try:
                self._planes_by_len[tokens] = self.recipe.plan(block)
            except KvtoolError as exc:
                self._fail(KvzFormatError, f"recipe does not fit the tensors: {exc}")
        return self._planes_by_len[tokens]

    def _check_index(self, data_start: int, data_end: int) -> None:
        """Chunks must tile the data region in order and cover every tensor block and plane exactly once.

        The number of chunks the manifest implies is computed, not listed, and
        compared with the index first: only then is anything done per chunk,
        and the index's own length is bounded by the file's.
        """
        idx = self.index
        full_blocks, rest = divmod(self.num_tokens, self.chunk_tokens)
        per_tensor = full_blocks * len(self.planes_for(self.chunk_tokens)) if full_blocks else 0
        per_tensor += len(self.planes_for(rest)) if rest else 0
        if len(self.tensors) * per_tensor != len(idx):
            self._fail(KvzCorruptError, f"index has {len(idx)} chunks, the manifest needs {len(self.tensors) * per_tensor}")
        if len(idx) and (np.any(idx["offset"] > data_end) or np.any(idx["stored_len"] > data_end)):
            self._fail(KvzCorruptError, "a chunk lies outside the data region")
        # Offsets and lengths are now below the file size, so these uint64 sums cannot wrap.
        if len(idx) and (idx["offset"][0] != data_start or np.any(idx["offset"][1:] != idx["offset"][:-1] + idx["stored_len"][:-1])):
            self._fail(KvzCorruptError, "chunk offsets do not tile the data region")
        end = int(idx["offset"][-1]) + int(idx["stored_len"][-1]) if len(idx) else data_start
        if end != data_end:
            self._fail(KvzCorruptError, "chunks do not end where the index begins")
        expected = []
        for t in range(len(self.tensors)):
            for start in range(0, self.num_tokens, self.chunk_tokens):
                count = min(self.chunk_tokens, self.num_tokens - start)
                for p, spec in enumerate(self.planes_for(count)):
                    expected.append((t, p, start, count, spec.nbytes))
        got = np.stack([idx["tensor"], idx["plane"], idx["token_start"], idx["token_count"], idx["raw_len"]], axis=1) if len(idx) else np.zeros((0, 5))
        if len(idx) and not np.array_equal(got.astype(np.int64), np.array(expected, dtype=np.int64)):
            self._fail(KvzCorruptError, "index entries do not match the tensor manifest")
        raw = (idx["flags"] & FLAG_STORED_RAW) != 0
        if (
            np.any(idx["flags"] & ~np.uint16(FLAG_STORED_RAW))
            or np.any(idx["stored_len"][raw] != idx["raw_len"][raw])
            or np.any(idx["stored_xxh3"][raw] != idx["raw_xxh3"][raw])
        ):
            self._fail(KvzCorruptError, "bad chunk flags: a chunk stored raw must have equal stored and raw length and hash")
        largest = max((nbytes for *_, nbytes in expected), default=0)
        if largest > self.max_size:
            self._fail(OutputTooLargeError, f"a chunk would decode to {largest} bytes, over the limit of {self.max_size}")
        self._rows: dict[tuple[int, int], list[int]] = {}
        for row, (t, _, start, _, _) in enumerate(expected):
            self._rows.setdefault((t, start), []).append(row)

    def _check_read_size(self, layers: Sequence[int] | None, tokens: slice | None) -> None:
        """Refuse, before anything is allocated, a read whose result would exceed ``max_size``."""
        n_layers = len(self.layer_ids) if layers is None else len(layers)
        start, stop = token_range(tokens, self.num_tokens)
        nbytes = 2 * n_layers * self._heads * (stop - start) * self._dim * self.dtype.itemsize
        if nbytes > self.max_size:
            self._fail(OutputTooLargeError, f"the cache read would be {nbytes} bytes, over the limit of {self.max_size}")

    # -- reading chunks ---------------------------------------------------------------------
    def _decode_block(self, tensor: int, start: int) -> np.ndarray:
        rows = self._rows[(tensor, start)]
        tokens = int(self.index[rows[0]]["token_count"])
        block_spec = PlaneSpec("data", (self._heads, tokens, self._dim), self.dtype.numpy)
        specs = self.planes_for(tokens)
        planes: list[np.ndarray] = []
        for row, spec in zip(rows, specs):
            entry = self.index[row]
            stored = self._source.read(int(entry["offset"]), int(entry["stored_len"]))
            if xxh3_64(stored) != int(entry["stored_xxh3"]):
                self._fail(KvzCorruptError, f"checksum mismatch in chunk {row} (layer {self.tensors[tensor][0]} {self.tensors[tensor][1]})")
            if entry["flags"] & FLAG_STORED_RAW:
                planes.append(np.frombuffer(stored, dtype=spec.dtype).reshape(spec.shape))
                continue  # its checksum, just verified, is the raw checksum too
            raw: bytes | np.ndarray
            plane: np.ndarray | None
            try:
                if self.recipe.array_codec is not None:
                    plane = self.recipe.array_codec.decode_array(stored, spec.shape, spec.dtype)
                    raw = plane.reshape(-1).view(np.uint8)
                else:
                    raw = self.recipe.codec_for(spec.name).decode(stored, max_size=int(entry["raw_len"]))
                    plane = np.frombuffer(raw, dtype=spec.dtype).reshape(spec.shape) if len(raw) == spec.nbytes else None
            except DecodeError as exc:
                self._fail(KvzCorruptError, f"chunk {row} does not decode: {exc}")
            if len(raw) != entry["raw_len"] or xxh3_64(raw) != int(entry["raw_xxh3"]):
                self._fail(KvzCorruptError, f"chunk {row} decodes to different bytes than were written")
            assert plane is not None  # a raw length other than the plane's failed the check above
            planes.append(plane)
        return self.recipe.layouts.for_kind(self.tensors[tensor][1]).inverse(planes, [block_spec])[0]

    def read(
        self,
        layers: Sequence[int] | None = None,
        tokens: slice | None = None,
        threads: int | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> KVCache:
        """Decode the cache, or only ``layers`` (model layer ids) and a token range, reading only their chunks.

        The tensors come back as views of one array, allocated once.
        """
        self._check_read_size(layers, tokens)
        wanted = self.layer_ids if layers is None else list(layers)
        missing = [l for l in wanted if l not in self.layer_ids]
        if missing:
            raise UsageError(f"{self.name}: no layers {missing} (it holds {self.layer_ids})")
        start, stop = token_range(tokens, self.num_tokens)
        positions = [2 * self.layer_ids.index(layer) + kv for layer in wanted for kv in (0, 1)]
        arena = np.empty((len(positions), self._heads if self.tensors else 0, stop - start, self._dim if self.tensors else 0), self.dtype.numpy)
        first = start - start % self.chunk_tokens
        blocks = [(out, t, block) for out, t in enumerate(positions) for block in range(first, stop, self.chunk_tokens)]
        batch = BatchCodec.for_recipe(self.recipe, self.dtype.numpy)
        if batch is not None:
            self._read_batch(batch, blocks, arena, start, threads, on_progress)
        else:
            self._read_blocks(blocks, arena, start, stop, threads, on_progress)
        tensors = list(arena)
        return KVCache(
            tensors[0::2], tensors[1::2], self.model, dict(self.provenance),
            layer_ids=list(wanted), token_start=self.token_start + start,
        )

    def _chunk_name(self, row: int) -> str:
        layer, kind, _ = self.tensors[int(self.index[row]["tensor"])]
        return f"chunk {row} (layer {layer} {kind})"

    def _read_blocks(self, blocks, arena: np.ndarray, start: int, stop: int, threads, on_progress) -> None:
        """The per-chunk path: each block through the recipe's codecs and layouts, then copied into place."""

        def decode_into(job) -> int:
            out, t, block = job
            array = self._decode_block(t, block)
            lo, hi = max(start, block), min(stop, block + array.shape[1])
            arena[out, :, lo - start : hi - start] = array[:, lo - block : hi - block]
            return array.nbytes

        for _, nbytes in _map_bounded(decode_into, blocks, threads):
            if on_progress:
                on_progress(nbytes)

    def _read_batch(self, batch: BatchCodec, blocks, arena: np.ndarray, start: int, threads, on_progress) -> None:
        """The batch path: chunks read in runs of about READ_RUN bytes, each run verified and decoded
        straight into ``arena`` by one native call; runs on a thread pool."""
        rows = np.array([self._rows[(t, block)][0] for _, t, block in blocks], dtype=np.int64)
        if not len(rows):
            return
        entries = self.index[rows]
        jobs = np.zeros(len(rows), JOB_DTYPE)
        jobs["offset"] = entries["offset"]
        jobs["stored_len"] = entries["stored_len"]
        jobs["stored_xxh3"] = entries["stored_xxh3"]
        jobs["raw_xxh3"] = entries["raw_xxh3"]
        jobs["out_index"] = [out for out, _, _ in blocks]
        jobs["flags"] = np.where(entries["flags"] & FLAG_STORED_RAW, JOB_STORED_RAW, 0)
        jobs["block_tokens"] = entries["token_count"]
        jobs["block_start"] = entries["token_start"].astype(np.int64) - start
        order = np.argsort(jobs["offset"], kind="stable")
        jobs, rows = jobs[order], rows[order]

        def decode_run(run: tuple[int, int]) -> int:
            lo, hi = run
            part = jobs[lo:hi].copy()
            base = int(part["offset"][0])
            part["offset"] -= base
            data = self._source.read_run(base, int(part["offset"][-1] + part["stored_len"][-1]))
            try:
                batch.decode(data, part, arena, lambda i: self._chunk_name(int(rows[lo + i])))
            except DecodeError as exc:
                self._fail(KvzCorruptError, str(exc))
            return int(part["block_tokens"].sum()) * self._heads * self._dim * self.dtype.itemsize

        for _, nbytes in _map_bounded(decode_run, _runs(jobs, READ_RUN), threads):
            if on_progress:
                on_progress(nbytes)

    def read_rows(self, targets: list[np.ndarray], rows: np.ndarray, target_of: Sequence[int], layers: Sequence[int] | None = None) -> None:
        """Decode ``layers`` (all by default) into other memory, row by row: row (head h, token t) of the
        i-th tensor read (K then V of each layer) goes to byte offset ``rows[i, h, t]`` of the flat byte
        array ``targets[target_of[i]]``; a negative offset leaves that row out.

        For destinations laid out otherwise than ``[heads, tokens, dim]``, such as an engine's paged
        KV blocks: with the native core each chunk goes from the stored bytes to its rows in one
        pass, with no intermediate cache. Offsets are checked against the targets before a byte is
        written.
        """
        wanted = self.layer_ids if layers is None else list(layers)
        positions = [2 * self.layer_ids.index(layer) + kv for layer in wanted for kv in (0, 1)]
        if rows.shape != (len(positions), self._heads, self.num_tokens) or len(target_of) != len(positions):
            raise UsageError(f"{self.name}: rows must be [{len(positions)}, {self._heads}, {self.num_tokens}] offsets")
        row_bytes = self._dim * self.dtype.itemsize
        for i, target in enumerate(target_of):
            limit = targets[target].nbytes - row_bytes
            if rows.size and rows[i].max() > limit:
                raise UsageError(f"{self.name}: row offsets fall outside their target")
        batch = BatchCodec.for_recipe(self.recipe, self.dtype.numpy)
        if batch is None:  # decode, then place the rows with numpy
            cache = self.read(layers=wanted, threads=1)
            for i, array in enumerate(t for _, _, t in cache.tensors()):
                _place_rows(targets[target_of[i]].reshape(-1).view(np.uint8), rows[i].reshape(-1),
                            np.ascontiguousarray(array).reshape(-1, self._dim).view(np.uint8))
            return
        blocks = [(i, t, start) for i, t in enumerate(positions) for start in range(0, self.num_tokens, self.chunk_tokens)]
        if not blocks:  # no tokens or no layers: nothing to place (the native core refuses an empty batch)
            return
        chunk_rows = np.array([self._rows[(t, start)][0] for _, t, start in blocks], dtype=np.int64)
        entries = self.index[chunk_rows]
        jobs = np.zeros(len(blocks), JOB_DTYPE)
        for name in ("offset", "stored_len", "stored_xxh3", "raw_xxh3"):
            jobs[name] = entries[name]
        jobs["out_index"] = [target_of[i] for i, _, _ in blocks]
        jobs["flags"] = np.where(entries["flags"] & FLAG_STORED_RAW, JOB_STORED_RAW, 0)
        jobs["block_tokens"] = entries["token_count"]
        ordered = [rows[i, :, start : start + int(n)].reshape(-1) for (i, _, start), n in zip(blocks, entries["token_count"])]
        starts = np.cumsum([0] + [len(r) for r in ordered[:-1]])
        first = int(jobs["offset"].min()) if jobs.size else 0
        data = self._source.read_run(first, int((jobs["offset"] + jobs["stored_len"]).max()) - first) if jobs.size else b""
        jobs["offset"] -= first
        try:
            batch.decode_rows(data, jobs, starts, np.concatenate(ordered) if ordered else np.zeros(0, np.int64),
                              [t.reshape(-1).view(np.uint8) for t in targets], self._heads, self._dim,
                              lambda i: self._chunk_name(int(chunk_rows[i])))
        except DecodeError as exc:
            self._fail(KvzCorruptError, str(exc))

    def verify(self, full: bool = False, on_progress: Callable[[int], None] | None = None) -> None:
        """Check every chunk's checksum; with ``full``, also decode every chunk and check its raw checksum.

        Each chunk is read once: a full check decodes block by block, which checks
        the stored checksum of each chunk before decoding it.
        """
        if full:
            for t in range(len(self.tensors)):
                for start in range(0, self.num_tokens, self.chunk_tokens):
                    self._decode_block(t, start)
                    if on_progress:
                        on_progress(sum(int(self.index[row]["raw_len"]) for row in self._rows[(t, start)]))
            return
        for row, entry in enumerate(self.index):
            stored = self._source.read(int(entry["offset"]), int(entry["stored_len"]))
            if xxhash.xxh3_64_intdigest(stored) != int(entry["stored_xxh3"]):
                self._fail(KvzCorruptError, f"checksum mismatch in chunk {row}")
            if on_progress:
                on_progress(int(entry["raw_len"]))

    def sizes(self) -> dict[str, Any]:
        """Raw and stored bytes per layer, per K/V and per plane, from the index alone."""
        raw = self.index["raw_len"].astype(np.int64)
        stored = self.index["stored_len"].astype(np.int64)
        specs = self.planes_for(min(self.chunk_tokens, self.num_tokens)) if self.num_tokens else []
        names = [s.name for s in specs]

        def group(keys) -> dict:
            out: dict = {}
            for key, r, s in zip(keys, raw, stored):
                entry = out.setdefault(key, [0, 0])
                entry[0] += int(r)
                entry[1] += int(s)
            return {k: {"raw": r, "stored": s, "ratio": r / s if s else 1.0} for k, (r, s) in out.items()}

        return {
            "total": group(["all"] * len(raw))["all"] if len(raw) else {"raw": 0, "stored": 0, "ratio": 1.0},
            "by_kind": group(self.tensors[t][1] for t in self.index["tensor"]),
            "by_layer": group(self.tensors[t][0] for t in self.index["tensor"]),
            "by_plane": group(names[p] for p in self.index["plane"]),
        }


def open_kvz(path: str | os.PathLike, max_size: int = DEFAULT_MAX_SIZE) -> KvzReader:
    """Open and validate a .kvz file (header, index, trailer); chunks are read on demand.

    ``max_size`` caps the bytes the reader decodes (see ``KvzReader``).
    """
    path = Path(path)
    return KvzReader(_FileSource(path), name=str(path), max_size=max_size)


def _place_rows(flat: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> None:
    """Row ``i`` of ``rows`` to byte offset ``offsets[i]`` of ``flat``; a negative offset leaves it out.

    Offsets that are all whole rows apart (an engine's paged blocks are) move a
    row per index; others move a byte per index, eight times the memory.
    """
    kept = offsets >= 0
    offsets, rows = offsets[kept], rows[kept]
    row_bytes = rows.shape[1]
    if row_bytes and not (offsets % row_bytes).any():
        flat[: flat.size // row_bytes * row_bytes].reshape(-1, row_bytes)[offsets // row_bytes] = rows
    else:
        flat[offsets[:, None] + np.arange(row_bytes)] = rows


def decode_cache(
    data: bytes | bytearray | memoryview,
    layers: Sequence[int] | None = None,
    tokens: slice | None = None,
    max_size: int = DEFAULT_MAX_SIZE,
) -> KVCache:
    """The cache held in .kvz bytes (all of it, or some layers and tokens), at most ``max_size`` bytes of it."""
    with KvzReader.from_bytes(data, max_size=max_size) as reader:
        return reader.read(layers=layers, tokens=tokens)


def is_kvz(path: str | os.PathLike) -> bool:
    """Whether ``path`` starts with the .kvz magic; refuses a path that is not a regular file."""
    with open_regular(path) as f:
        return f.read(len(MAGIC)) == MAGIC


def _depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects, counted up to ``MAX_JSON_DEPTH + 1``."""
    depth, level = 0, [value]
    while depth <= MAX_JSON_DEPTH:
        containers = [item for item in level if isinstance(item, (dict, list))]
        if not containers:
            return depth
        depth += 1
        level = [child for item in containers for child in (item.values() if isinstance(item, dict) else item)]
    return depth


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} does not fit a 64-bit float")
    return value


def _brief(value: Any) -> str:
    """A short repr for messages about values read from a file."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
