"""A .kvz's header and index as one frozen value: parsed, then validated, once, before a reader exists.

As safetensors reads a file (``read_metadata``, then ``validate``): ``read_metadata``
checks the frame (magic, version, trailer, lengths, checksums) and returns the
header's JSON and the index; ``KvzHeader.validate`` checks every number in them
against the file's size and fixed bounds before anything is computed from it, so
a crafted file costs work in proportion to its own size.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, NoReturn

import numpy as np
import xxhash

from kvtool.dtypes import DType, dtype_of
from kvtool.errors import DecodeError, KvtoolError
from kvtool.facts import AXES, ModelFacts
from kvtool.cache import MAX_LAYER_ID
from kvtool.kvz.format import (
    END_MAGIC, FLAG_STORED_RAW, INDEX_DTYPE, MAGIC, MAX_CHUNK_TOKENS, MAX_HEADER, MAX_JSON_DEPTH,
    MAX_ROW_BYTES, MAX_TOKEN_START, MAX_TOKENS, PREAMBLE, TRAILER, VERSION, KvzCorruptError, KvzError, KvzFormatError,
    trailer_hash,
)
from kvtool.kvz.sources import ByteSource
from kvtool.layouts.base import PlaneSpec
from kvtool.recipe import Recipe

Tensor = tuple[int, str, tuple[int, int, int]]  # layer id, "k" or "v", [heads, tokens, dim]
#: The bytes of an index record that the manifest fixes: tensor, plane, token start and count, raw length.
_MANIFEST_BYTES = np.r_[0:6, 8:16, 32:40]


@dataclass(frozen=True, eq=False)
class Metadata:
    """What ``read_metadata`` found inside a sound frame: the header's bytes (checksum verified) and the index."""

    header: bytes
    index: np.ndarray  # INDEX_DTYPE records, read-only
    data_start: int  # where the chunks begin
    data_end: int  # where the index begins


def read_metadata(source: ByteSource, name: str) -> Metadata:
    """Check the frame of a .kvz (magic, version, trailer, lengths, checksums); read its header and index."""
    size = source.size
    if size < PREAMBLE.size + TRAILER.size:
        if size >= 8 and bytes(source.read(0, 8)) != MAGIC:
            _fail(KvzFormatError, name, "not a .kvz file")
        _fail(KvzCorruptError, name, f"truncated: only {size} bytes")
    magic, version, header_len = PREAMBLE.unpack(source.read(0, PREAMBLE.size))
    if magic != MAGIC:
        _fail(KvzFormatError, name, "not a .kvz file (bad magic)")
    if version != VERSION:
        _fail(KvzFormatError, name, f"format version {version} is not supported (this kvtool reads version {VERSION})")
    *fields, checksum, end = TRAILER.unpack(source.read(size - TRAILER.size, TRAILER.size))
    if end != END_MAGIC or checksum != trailer_hash(fields):
        _fail(KvzCorruptError, name, "the trailer is damaged or missing (truncated or corrupt file)")
    # struct gives Python ints: none of the sums below can wrap around.
    index_offset, index_len, n_chunks, trailer_header_len, header_hash, index_hash = fields
    if trailer_header_len != header_len or header_len > MAX_HEADER:
        _fail(KvzCorruptError, name, f"header length {header_len} disagrees with the trailer or exceeds {MAX_HEADER}")
    data_start = PREAMBLE.size + header_len
    if index_len != n_chunks * INDEX_DTYPE.itemsize or index_offset < data_start:
        _fail(KvzCorruptError, name, "index size or position is inconsistent")
    if index_offset + index_len + TRAILER.size != size:
        _fail(KvzCorruptError, name, "the file length does not match the trailer (trailing or missing bytes)")
    header_bytes = bytes(source.read(PREAMBLE.size, header_len))
    if xxhash.xxh3_64_intdigest(header_bytes) != header_hash:
        _fail(KvzCorruptError, name, "header checksum mismatch")
    index_bytes = bytes(source.read(index_offset, index_len))
    if xxhash.xxh3_64_intdigest(index_bytes) != index_hash:
        _fail(KvzCorruptError, name, "index checksum mismatch")
    return Metadata(header_bytes, np.frombuffer(index_bytes, dtype=INDEX_DTYPE), data_start, index_offset)


@dataclass(frozen=True, eq=False)
class HeaderFacts:
    """What a header's bytes say, checked once: shared by every file with the same header."""

    chunk_tokens: int
    token_start: int
    tensors: tuple[Tensor, ...]
    provenance: dict[str, Any]
    metadata: dict[str, str]
    dtype: DType
    model: ModelFacts
    recipe: Recipe
    lossy: dict[str, Any] | None
    num_tokens: int
    layer_ids: tuple[int, ...]
    heads: int
    dim: int
    #: The recipe's planes for a block of ``chunk_tokens`` tokens and for the last, shorter one.
    block_planes: dict[int, tuple[PlaneSpec, ...]] = field(repr=False)

    @property
    def chunks_per_tensor(self) -> int:
        full, rest = divmod(self.num_tokens, self.chunk_tokens)
        return (full * len(self.block_planes[self.chunk_tokens]) if full else 0) + (len(self.block_planes[rest]) if rest else 0)


@dataclass(frozen=True, eq=False)
class KvzHeader(HeaderFacts):
    """Everything a reader knows before it decodes a chunk, checked to be consistent: its header's facts, its name
    and its index."""

    name: str = ""
    index: np.ndarray = field(default_factory=lambda: np.zeros(0, INDEX_DTYPE), repr=False)

    @classmethod
    def validate(cls, meta: Metadata, name: str) -> "KvzHeader":
        """The header value of a frame ``read_metadata`` accepted, or ``KvzFormatError`` / ``KvzCorruptError``.

        What the header's bytes say is worked out once per process for each distinct header (``_facts``: the
        entries of one model and recipe share theirs); the index is checked against it for every file.
        """
        try:
            facts = _facts(meta.header)
        except KvzError as exc:
            raise type(exc)(f"{name}: {exc}") from None
        shared = {f.name: getattr(facts, f.name) for f in fields(HeaderFacts)}
        value = cls(**{**shared, "provenance": dict(facts.provenance), "metadata": dict(facts.metadata)}, name=name,
                    index=meta.index)
        value._check_index(meta.data_start, meta.data_end, functools.partial(_index_manifest, facts))
        return value

    def planes_for(self, tokens: int) -> tuple[PlaneSpec, ...]:
        """The recipe's planes for a block of ``tokens`` tokens (a whole block or the last one)."""
        return self.block_planes[tokens]


    def first_row(self, tensor: np.ndarray, start: np.ndarray) -> np.ndarray:
        """The index record of the first plane of each block (tensor, first token): records follow the manifest."""
        per_block = len(self.block_planes[min(self.chunk_tokens, self.num_tokens)]) if self.num_tokens else 0
        return tensor.astype(np.int64) * self.chunks_per_tensor + start.astype(np.int64) // self.chunk_tokens * per_block

    def block_rows(self, tensor: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per block (tensor, first token): its first index record, its token count and its number of planes."""
        first = self.first_row(tensor, start)
        tokens = np.minimum(self.num_tokens - start.astype(np.int64), self.chunk_tokens)
        full = len(self.block_planes[self.chunk_tokens]) if self.num_tokens >= self.chunk_tokens else 0
        rest = self.num_tokens % self.chunk_tokens
        planes = np.where(tokens == self.chunk_tokens, full, len(self.block_planes[rest]) if rest else 0)
        return first, tokens, planes.astype(np.int64)

    def describe(self, row: int) -> str:
        """``chunk N (layer L k)``, for messages."""
        layer, kind, _ = self.tensors[int(self.index[row]["tensor"])]
        return f"chunk {row} (layer {layer} {kind})"

    def chunk_error(self, cls: type[KvzError], row: int, message: str) -> KvzError:
        """An error about chunk ``row``, with its layer and kind as data."""
        layer, kind, _ = self.tensors[int(self.index[row]["tensor"])]
        return cls(f"{self.name}: {message}", chunk=row, layer=layer, kind=kind)

    def _check_index(self, data_start: int, data_end: int, manifest: Callable[[int], np.ndarray]) -> None:
        """Chunks must tile the data region in order and cover every tensor block and plane exactly once.

        The number of chunks the manifest implies is computed, not listed, and
        compared with the index first: only then is anything done per chunk,
        and the index's own length is bounded by the file's. ``manifest(n)`` gives
        the bytes every index record of ``n`` tensors holds in ``_MANIFEST_BYTES``.
        """
        idx, name = self.index, self.name
        needed = len(self.tensors) * self.chunks_per_tensor if self.num_tokens else 0
        if needed != len(idx):
            _fail(KvzCorruptError, name, f"index has {len(idx)} chunks, the manifest needs {needed}")
        if not len(idx):
            if data_start != data_end:
                _fail(KvzCorruptError, name, "chunks do not end where the index begins")
            return
        offset, length = idx["offset"], idx["stored_len"]
        if max(int(offset.max()), int(length.max())) > data_end:
            _fail(KvzCorruptError, name, "a chunk lies outside the data region")
        # Offsets and lengths are now below the file size, so these uint64 sums cannot wrap.
        ends = offset + length
        if offset[0] != data_start or np.any(offset[1:] != ends[:-1]):
            _fail(KvzCorruptError, name, "chunk offsets do not tile the data region")
        if int(ends[-1]) != data_end:
            _fail(KvzCorruptError, name, "chunks do not end where the index begins")
        records = idx.view(np.uint8).reshape(len(idx), INDEX_DTYPE.itemsize)
        if not np.array_equal(records[:, _MANIFEST_BYTES], manifest(len(self.tensors))):
            _fail(KvzCorruptError, name, "index entries do not match the tensor manifest")
        flags = idx["flags"]
        raw = flags == FLAG_STORED_RAW
        if np.any(flags > FLAG_STORED_RAW) or (raw.any() and (
                np.any(length[raw] != idx["raw_len"][raw]) or np.any(idx["stored_xxh3"][raw] != idx["raw_xxh3"][raw]))):
            _fail(KvzCorruptError, name, "bad chunk flags: a chunk stored raw must have equal stored and raw length and hash")


@functools.lru_cache(maxsize=32)
def _facts(data: bytes) -> HeaderFacts:
    """Parse and check a header's bytes (messages without the file's name, which the caller adds)."""
    name = ""
    header = _header_json(data, name)
    if header.get("format") != "kvz" or header.get("version") != VERSION:
        _fail(KvzFormatError, name, "header does not describe a version-1 .kvz")
    if header.get("axes") != list(AXES):
        _fail(KvzFormatError, name, f"unsupported axes {_brief(header.get('axes'))}")
    chunk_tokens = _int(name, header.get("chunk_tokens"), "chunk_tokens", 1, MAX_CHUNK_TOKENS)
    token_start = _int(name, header.get("token_start"), "token_start", 0, MAX_TOKEN_START)
    tensors = tuple(_tensor(name, t) for t in _typed(name, header.get("tensors"), list, "tensors"))
    provenance = dict(_typed(name, header.get("provenance"), dict, "provenance"))
    metadata = _typed(name, header.get("metadata", {}), dict, "metadata")
    if not all(isinstance(v, str) for v in metadata.values()):
        _fail(KvzFormatError, name, "user metadata must map strings to strings")
    try:
        dtype = dtype_of(_typed(name, header.get("dtype"), str, "dtype"))
        model = ModelFacts.from_dict(_typed(name, header.get("model"), dict, "model"))
        recipe = Recipe.from_config(header.get("recipe"))
    except DecodeError:
        raise
    except KvtoolError as exc:
        _fail(KvzFormatError, name, f"header names something this kvtool cannot rebuild: {exc}")
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        _fail(KvzFormatError, name, f"malformed header ({type(exc).__name__}: {str(exc)[:200]})")
    heads, num_tokens, dim, layer_ids = _manifest(name, tensors, dtype)
    lossy = _lossy_marker(name, header.get("lossy"), recipe)
    block_planes = {
        tokens: _plan(name, recipe, PlaneSpec("data", (heads, tokens, dim), dtype.numpy))
        for tokens in {min(chunk_tokens, num_tokens), num_tokens % chunk_tokens} if tokens
    }
    return HeaderFacts(chunk_tokens, token_start, tensors, provenance, dict(metadata), dtype, model, recipe, lossy,
                       num_tokens, layer_ids, heads, dim, block_planes)


@functools.lru_cache(maxsize=32)
def _index_manifest(facts: HeaderFacts, tensors: int) -> np.ndarray:
    """The bytes ``_MANIFEST_BYTES`` of every index record of a file of ``tensors`` tensors with these facts: the fields
    the manifest fixes (tensor, plane, token start and count, raw length). Asked for only after an index of as many
    chunks was read, so a header cannot make a reader list more than its file holds."""
    chunks = [(p, start, min(facts.chunk_tokens, facts.num_tokens - start), spec.nbytes)
              for start in range(0, facts.num_tokens, facts.chunk_tokens)
              for p, spec in enumerate(facts.block_planes[min(facts.chunk_tokens, facts.num_tokens - start)])]
    one = np.array(chunks, dtype=np.int64).reshape(-1, 4)
    records = np.zeros(tensors * len(one), INDEX_DTYPE)
    records["tensor"] = np.repeat(np.arange(tensors), len(one))
    for column, name in enumerate(("plane", "token_start", "token_count", "raw_len")):
        records[name] = np.tile(one[:, column], tensors)
    manifest = records.view(np.uint8).reshape(len(records), INDEX_DTYPE.itemsize)[:, _MANIFEST_BYTES]
    manifest.flags.writeable = False
    return manifest


def _fail(cls: type[KvzError], name: str, message: str) -> NoReturn:
    raise cls(f"{name}: {message}" if name else message)


def _header_json(data: bytes, name: str) -> dict[str, Any]:
    """The header as a JSON object of bounded depth holding only finite numbers."""
    try:
        header = json.loads(data, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        _fail(KvzFormatError, name, f"header nests deeper than {MAX_JSON_DEPTH} levels")
    except ValueError as exc:
        _fail(KvzFormatError, name, f"header is not valid JSON ({str(exc)[:200]})")
    if not isinstance(header, dict):
        _fail(KvzFormatError, name, "header is not a JSON object")
    if json_depth(header) > MAX_JSON_DEPTH:
        _fail(KvzFormatError, name, f"header nests deeper than {MAX_JSON_DEPTH} levels")
    return header


def shape_problem(heads: int, dim: int, itemsize: int) -> str | None:
    """What is wrong with a cache's ``[heads, ., dim]`` for a .kvz, or None: the one check the
    writer (before it writes) and the reader (before it decodes) both make."""
    if heads < 1 or dim < 1:
        return f"a cache needs at least one head and a head_dim of at least 1, not {heads} heads of {dim}"
    if heads * dim * itemsize > MAX_ROW_BYTES:
        return "tensor rows are implausibly large"
    return None


def _manifest(name: str, tensors: tuple[Tensor, ...], dtype: DType) -> tuple[int, int, int, tuple[int, ...]]:
    """``(heads, tokens, dim, layer ids)`` of a manifest listing K then V of each layer, all of one shape."""
    if not tensors:
        return 0, 0, 0, ()
    shapes = {shape for _, _, shape in tensors}
    if len(shapes) != 1:
        _fail(KvzFormatError, name, f"tensor shapes must be one shared [heads, tokens, dim], found {len(shapes)} different ones")
    heads, num_tokens, dim = next(iter(shapes))
    problem = shape_problem(heads, dim, dtype.itemsize)
    if problem:
        _fail(KvzFormatError, name, problem)
    layer_ids = tuple(layer for layer, kind, _ in tensors if kind == "k")
    if [kind for _, kind, _ in tensors] != ["k", "v"] * len(layer_ids) or tuple(t[0] for t in tensors[1::2]) != layer_ids:
        _fail(KvzFormatError, name, "the tensor manifest must list K then V for each layer")
    if len(set(layer_ids)) != len(layer_ids):
        _fail(KvzFormatError, name, "a layer appears twice in the manifest")
    return heads, num_tokens, dim, layer_ids


def _plan(name: str, recipe: Recipe, block: PlaneSpec) -> tuple[PlaneSpec, ...]:
    try:
        return tuple(recipe.plan(block))
    except KvtoolError as exc:
        _fail(KvzFormatError, name, f"recipe does not fit the tensors: {exc}")


def _lossy_marker(name: str, marker: Any, recipe: Recipe) -> dict[str, Any] | None:
    """The header's ``lossy`` object: there exactly when the recipe has a lossy stage."""
    if marker is None and not recipe.lossy:
        return None
    if not recipe.lossy or not isinstance(marker, dict) or not isinstance(marker.get("error"), list):
        _fail(KvzFormatError, name, f"the 'lossy' marker must be present exactly when the recipe is lossy ({recipe.spec()!r})")
    for row in marker["error"]:
        if not isinstance(row, dict) or not all(type(row.get(k)) in (int, float) for k in ("layer", "max_abs", "rms", "rel_rms")):
            _fail(KvzFormatError, name, "the 'lossy' marker's error rows need a layer, max_abs, rms and rel_rms")
    return marker


def _int(name: str, value: Any, what: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        _fail(KvzFormatError, name, f"{what} must be an integer in {lo}..{hi}, not {_brief(value)}")
    return value


def _typed(name: str, value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        _fail(KvzFormatError, name, f"{what} must be a JSON {'object' if kind is dict else kind.__name__}, not {_brief(value)}")
    return value


def _tensor(name: str, entry: Any) -> Tensor:
    entry = _typed(name, entry, dict, "a tensor entry")
    shape = _typed(name, entry.get("shape"), list, "a tensor shape")
    if len(shape) != 3 or entry.get("kind") not in ("k", "v"):
        _fail(KvzFormatError, name, f"a tensor entry needs kind 'k' or 'v' and a [heads, tokens, dim] shape, not {_brief(entry)}")
    heads, tokens, dim = (_int(name, n, "a tensor dimension", 0, bound) for n, bound in zip(shape, (MAX_ROW_BYTES, MAX_TOKENS, MAX_ROW_BYTES)))
    return _int(name, entry.get("layer"), "a layer id", 0, MAX_LAYER_ID), entry["kind"], (heads, tokens, dim)


def json_depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects, counted up to ``MAX_JSON_DEPTH + 1``."""
    depth, level = 0, [value]
    while depth <= MAX_JSON_DEPTH:
        containers = [item for item in level if isinstance(item, (dict, list))]
        if not containers:
            return depth
        depth += 1
        level = [child for item in containers for child in (item.values() if isinstance(item, dict) else item)]
    return depth


def _no_constant(text: str) -> NoReturn:
    raise ValueError(f"{text} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} does not fit a 64-bit float")
    return value


def _brief(value: Any) -> str:
    """A short repr for messages about values read from a file."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
