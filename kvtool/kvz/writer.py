"""Writing a .kvz: a cache streamed as checksummed chunks, header first, index and trailer last.

The encoding path is chosen once per write, from the recipe: the native batch
(each tensor cut and coded in one call of the core) where the core implements
the recipe, else per chunk (any recipe, blocks on a thread pool). Both write the
same bytes. A lossy recipe's chunks wait in memory until the header, which
carries the error they cost, is written.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

import numpy as np
import xxhash

from kvtool._native import xxh3_64
from kvtool._native.batch import BatchCodec
from kvtool.cache import KVCache
from kvtool.errors import UsageError
from kvtool.facts import AXES
from kvtool.fileio import atomic_write
from kvtool.kvz.format import (
    DEFAULT_CHUNK_TOKENS, FLAG_STORED_RAW, INDEX_DTYPE, MAGIC, MAX_CHUNK_TOKENS, MAX_HEADER, MAX_JSON_DEPTH, PREAMBLE,
    TRAILER, VERSION, END_MAGIC, trailer_hash,
)
from kvtool.kvz.header import json_depth, shape_problem
from kvtool.kvz.pipeline import map_bounded
from kvtool.layouts.base import PlaneSpec
from kvtool.layouts.lossy import ErrorTally
from kvtool.recipe import DEFAULT_RECIPE, Recipe

Record = tuple[int, int, int, int, int, int, int, int, int, int]  # an INDEX_DTYPE record
Tensors = list[tuple[int, str, np.ndarray]]
EncodedPlane = tuple[int, int, int, int, "bytes | memoryview"]  # flags, raw length, raw hash, stored hash, stored bytes


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
        heads, _, dim = tensors[0][2].shape
        problem = shape_problem(heads, dim, tensors[0][2].itemsize)  # what a reader would refuse is never written
        if problem:
            raise UsageError(problem)
        recipe.plan(PlaneSpec.of(tensors[0][2][:, :1]))  # fail early on a recipe that does not fit the dtype
    records: list[Record] = []
    if recipe.lossy:
        # The header carries the error each tensor's round trip cost, known once every block is
        # encoded: the chunks wait in memory (a fraction of the cache) and follow the header.
        tally = ErrorTally(tensors)
        body = io.BytesIO()
        _write_blocks(body, tensors, recipe, chunk_tokens, threads, 0, records, on_progress, tally, cache.token_start)
        header = _header_bytes(cache, recipe, chunk_tokens, metadata or {}, tally.rows())
        offset = PREAMBLE.size + len(header)
        records = [(*r[:5], r[5] + offset, *r[6:]) for r in records]
        out.write(PREAMBLE.pack(MAGIC, VERSION, len(header)))
        out.write(header)
        out.write(body.getbuffer())
        offset += body.tell()
    else:
        header = _header_bytes(cache, recipe, chunk_tokens, metadata or {})
        out.write(PREAMBLE.pack(MAGIC, VERSION, len(header)))
        out.write(header)
        offset = PREAMBLE.size + len(header)
        batch = recipe.batch_kernel(cache.dtype.numpy)
        if batch is not None:
            offset = _write_tensors(out, tensors, batch, chunk_tokens, threads, offset, records, on_progress)
        else:
            offset = _write_blocks(out, tensors, recipe, chunk_tokens, threads, offset, records, on_progress,
                                   token_start=cache.token_start)
    index = np.array(records, dtype=INDEX_DTYPE).tobytes()
    out.write(index)
    fields = (offset, len(index), len(records), len(header), xxhash.xxh3_64_intdigest(header), xxhash.xxh3_64_intdigest(index))
    out.write(TRAILER.pack(*fields, trailer_hash(fields), END_MAGIC))
    return offset + len(index) + TRAILER.size


def _write_blocks(out: BinaryIO, tensors: Tensors, recipe: Recipe, chunk_tokens: int, threads: int | None, offset: int,
                  records: list[Record], on_progress: Callable[[int], None] | None, tally: ErrorTally | None = None,
                  token_start: int = 0) -> int:
    """The per-chunk path: any recipe, one block at a time through its layouts and codecs (bound to the block's
    tensor and sequence position, the cache starting at ``token_start``); a lossy recipe's round trip error goes
    to ``tally``."""
    blocks = (
        _Block(i, start, array[:, start : start + chunk_tokens])
        for i, (_, _, array) in enumerate(tensors)
        for start in range(0, array.shape[1], chunk_tokens)
    )

    bound = [recipe.for_kind(kind, layer) for layer, kind, _ in tensors]  # once a tensor, not once a block
    start, end = token_start, token_start + (tensors[0][2].shape[1] if tensors else 0)

    def encode(block: _Block) -> tuple[list[EncodedPlane], Any]:
        return _encode_block(block, bound[block.tensor].for_block(start + block.token_start, end), tally is not None)

    for block, (chunks, error) in map_bounded(encode, blocks, threads):
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


def _write_tensors(out: BinaryIO, tensors: Tensors, batch: BatchCodec, chunk_tokens: int, threads: int | None, offset: int,
                   records: list[Record], on_progress: Callable[[int], None] | None) -> int:
    """The batch path: each tensor's blocks cut and coded in one native call, tensors on a thread pool."""
    jobs = ((i, array) for i, (_, _, array) in enumerate(tensors))
    for (i, array), (blob, meta) in map_bounded(lambda job: batch.encode_tensor(job[1], chunk_tokens), jobs, threads):
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


def _encode_block(block: _Block, recipe: Recipe, measure: bool = False) -> tuple[list[EncodedPlane], Any]:
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
    out: list[EncodedPlane] = []
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
    if json_depth(header) > MAX_JSON_DEPTH:
        raise UsageError(f"provenance is nested deeper than a .kvz header allows ({MAX_JSON_DEPTH} levels)")
    try:
        data = json.dumps(header, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    except ValueError as exc:
        raise UsageError(f"provenance holds a value JSON cannot carry: {exc}") from None
    if len(data) > MAX_HEADER:
        raise UsageError(f"the header would be {len(data)} bytes, over the {MAX_HEADER}-byte limit")
    return data


def save(
    cache: KVCache,
    path: str | os.PathLike[str],
    recipe: Recipe | str = DEFAULT_RECIPE,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    threads: int | None = None,
    metadata: dict[str, str] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> int:
    """Write ``cache`` to a .kvz file atomically; return its size in bytes."""
    with atomic_write(path) as f:
        return write_cache(f, cache, recipe, chunk_tokens, threads, metadata, on_progress)


def encode_cache(cache: KVCache, recipe: Recipe | str = DEFAULT_RECIPE, **kwargs: Any) -> bytes:
    """The .kvz bytes of ``cache``, for stores and network transfers."""
    buf = io.BytesIO()
    write_cache(buf, cache, recipe, **kwargs)
    return buf.getvalue()
