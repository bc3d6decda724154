"""Write the crafted .kvz corpus (run once; the tests read the committed files on every run).

    python tests/fuzz/make_corpus.py

Each file is a small real cache (layers 0 and 29, tokens 0-11 of
samples/code.safetensors, 4-token chunks) with one part crafted as a hostile
writer would: numbers beyond every bound, wrong JSON types, deep nesting, an
index whose lengths wrap 64-bit arithmetic, chunks that decode to more than
their plane, headers claiming gigabytes or a terabyte. Header, index and trailer
checksums are valid, so each reaches the reader's checks of content.
``corpus.json`` names, for each file, what it is and the error a reader must
end in; every file must end in that error within 2 s and 256 MB. A chunk that its
codec refuses (garbage, or more bytes than its plane) is a ``KvzCorruptError``
naming the chunk and the codec's reason.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash
import zlib
import zstandard
import lz4.frame

from kvtool.cache import KVCache
from kvtool.kvz import encode_cache
from kvtool.kvz.format import FLAG_STORED_RAW, INDEX_DTYPE

sys.path.insert(0, str(Path(__file__).parent))
from forge import Parts, Raw, assemble, dissect  # noqa: E402

HERE = Path(__file__).parent
CORPUS = HERE / "corpus"
SAMPLE = HERE.parents[1] / "samples" / "code.safetensors"
GiB = 1 << 30


def base(recipe: str = "byteplane|zstd:1") -> Parts:
    cache = KVCache.load(SAMPLE, layers=[0, 29], tokens=slice(0, 12))
    return dissect(encode_cache(cache, recipe, chunk_tokens=4, threads=1))


def header(path: str, value) -> Callable[[], bytes]:
    """The base file with one header field (``a.b.0.c``) replaced."""

    def build() -> bytes:
        parts = base()
        *parents, last = path.split(".")
        node = parts.header
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
        return assemble(parts)

    return build


def whole_header(value) -> Callable[[], bytes]:
    def build() -> bytes:
        parts = base()
        parts.header = value
        return assemble(parts)

    return build


def index_edit(edit: Callable[[np.ndarray], None], tile: bool = False, recipe: str = "byteplane|zstd:1") -> Callable[[], bytes]:
    def build() -> bytes:
        parts = base(recipe)
        edit(parts.index)
        return assemble(parts, tile=tile)

    return build


def wrapped_lengths(index: np.ndarray) -> None:
    """Chunk 0 claims 2^64 - 1 bytes, so chunk 1 "starts" one byte before it and spans both: it all tiles modulo 2^64."""
    len0 = int(index["stored_len"][0])
    index["stored_len"][0] = (1 << 64) - 1
    index["offset"][1] = int(index["offset"][0]) - 1
    index["stored_len"][1] += len0 + 1


def swapped_records(index: np.ndarray) -> None:
    index[[0, 1]] = index[[1, 0]]


def claim(shape: list[int], chunk_tokens: int, payload: Callable[[int], tuple[bytes, int]], recipe: str = "zstd:1") -> Callable[[], bytes]:
    """One layer whose K and V claim ``shape``, with an index that matches the claim chunk for chunk.

    ``payload(raw_len)`` gives each chunk's stored bytes and its raw checksum.
    """

    def build() -> bytes:
        parts = base(recipe)
        heads, tokens, dim = shape
        parts.header["tensors"] = [{"kind": kind, "layer": 0, "shape": shape} for kind in ("k", "v")]
        parts.header["chunk_tokens"] = chunk_tokens
        records, chunks = [], []
        for tensor in (0, 1):
            for start in range(0, tokens, chunk_tokens):
                count = min(chunk_tokens, tokens - start)
                raw_len = heads * count * dim * 2
                stored, raw_hash = payload(raw_len)
                chunks.append(stored)
                records.append((tensor, 0, 0, start, count, 0, len(stored), raw_len, 0, raw_hash))
        parts.index = np.array(records, dtype=INDEX_DTYPE)
        parts.chunks = chunks
        return assemble(parts)

    return build


def zstd_zeros(raw_len: int) -> tuple[bytes, int]:
    """A valid zstd frame of ``raw_len`` zero bytes, made in 1 MiB steps, and the zeros' checksum."""
    block = bytes(1 << 20)
    compressor = zstandard.ZstdCompressor(level=1, write_checksum=True).compressobj(size=raw_len)
    digest, frame, left = xxhash.xxh3_64(), [], raw_len
    while left:
        piece = block[: min(left, len(block))]
        frame.append(compressor.compress(piece))
        digest.update(piece)
        left -= len(piece)
    frame.append(compressor.flush())
    return b"".join(frame), digest.intdigest()


def one_byte(raw_len: int) -> tuple[bytes, int]:
    return b"\0", 0


def payload_edit(row: int, make: Callable[[int], bytes], recipe: str = "byteplane|zstd:1") -> Callable[[], bytes]:
    """The base file with chunk ``row`` replaced by ``make(raw_len)``; its stored checksum fits the new bytes."""

    def build() -> bytes:
        parts = base(recipe)
        parts.chunks[row] = make(int(parts.index[row]["raw_len"]))
        parts.index["flags"][row] = 0
        return assemble(parts)

    return build


def nested(depth: int) -> Raw:
    return Raw("[" * depth + "]" * depth)


CASES: dict[str, tuple[str, Callable[[], bytes], str]] = {
    # counts the reader once listed block by block before comparing them with the index
    "tokens-2pow40": ("tensors claim 2^40 tokens in 1-token chunks", lambda: (
        lambda p: (p.header.update(chunk_tokens=1, tensors=[{"kind": k, "layer": 0, "shape": [1, 1 << 40, 1]} for k in "kv"]), assemble(p))[1])(base()), "KvzFormatError"),
    "tokens-u32-max": ("tensors claim 2^32-1 tokens in 1-token chunks, with the index of a small file", lambda: (
        lambda p: (p.header.update(chunk_tokens=1, tensors=[{"kind": k, "layer": 0, "shape": [1, (1 << 32) - 1, 1]} for k in "kv"]), assemble(p))[1])(base()), "KvzCorruptError"),
    # numbers that are not integers in range
    "chunk-tokens-1e400": ("chunk_tokens is 1e400", header("chunk_tokens", Raw("1e400")), "KvzFormatError"),
    "token-start-1e400": ("token_start is 1e400", header("token_start", Raw("1e400")), "KvzFormatError"),
    "shape-1e400": ("a tensor dimension is 1e400", header("tensors.0.shape.1", Raw("1e400")), "KvzFormatError"),
    "codec-level-1e400": ("the codec level is 1e400", header("recipe.codec.level", Raw("1e400")), "KvzFormatError"),
    "model-layers-1e400": ("model.num_layers is 1e400", header("model.num_layers", Raw("1e400")), "KvzFormatError"),
    "provenance-nan": ("a provenance value is NaN", header("provenance.x", Raw("NaN")), "KvzFormatError"),
    "chunk-tokens-float": ("chunk_tokens is 4.0", header("chunk_tokens", 4.0), "KvzFormatError"),
    "chunk-tokens-string": ("chunk_tokens is the string '4'", header("chunk_tokens", "4"), "KvzFormatError"),
    "chunk-tokens-bool": ("chunk_tokens is true", header("chunk_tokens", True), "KvzFormatError"),
    "chunk-tokens-zero": ("chunk_tokens is 0", header("chunk_tokens", 0), "KvzFormatError"),
    "chunk-tokens-2pow21": ("chunk_tokens is 2^21, over the limit", header("chunk_tokens", 1 << 21), "KvzFormatError"),
    "token-start-negative": ("token_start is -1", header("token_start", -1), "KvzFormatError"),
    "token-start-2pow64": ("token_start is 2^64", header("token_start", 1 << 64), "KvzFormatError"),
    "codec-level-2pow100": ("the codec level is 2^100", header("recipe.codec.level", 1 << 100), "KvzFormatError"),
    "codec-level-list": ("the codec level is a list", header("recipe.codec.level", [3]), "KvzFormatError"),
    "layout-param-1e400": ("a layout parameter is 1e400", lambda: (lambda p: (p.header["recipe"]["layouts"].append({"id": "xor-delta", "axis": Raw("1e400")}), assemble(p))[1])(base()), "KvzFormatError"),
    "huge-rows": ("one token of one tensor claims 2^41 bytes", header("tensors", [{"kind": k, "layer": 0, "shape": [1 << 20, 12, 1 << 20]} for k in "kv"]), "KvzFormatError"),
    # JSON shapes
    "nested-100000": ("provenance nested 100,000 deep", header("provenance", nested(100_000)), "KvzFormatError"),
    "nested-40": ("provenance nested 40 deep, past the 32-level bound", header("provenance", nested(40)), "KvzFormatError"),
    "header-array": ("the header is a JSON array", whole_header([1, 2, 3]), "KvzFormatError"),
    "header-string": ("the header is a JSON string", whole_header("kvz"), "KvzFormatError"),
    "tensors-object": ("tensors is an object", header("tensors", {"0": 1}), "KvzFormatError"),
    "shape-2d": ("a tensor shape has two dimensions", header("tensors.0.shape", [3, 12]), "KvzFormatError"),
    "kind-x": ("a tensor kind is 'x'", header("tensors.0.kind", "x"), "KvzFormatError"),
    "layer-negative": ("a layer id is -1", header("tensors.0.layer", -1), "KvzFormatError"),
    "layer-twice": ("two layers share an id", lambda: (lambda p: ([t.update(layer=0) for t in p.header["tensors"]], assemble(p))[1])(base()), "KvzFormatError"),
    "metadata-number": ("a user metadata value is a number", header("metadata", {"n": 1}), "KvzFormatError"),
    "provenance-list": ("provenance is a list", header("provenance", [1]), "KvzFormatError"),
    "model-string-layers": ("model.num_layers is a string", header("model.num_layers", "30"), "KvzFormatError"),
    "recipe-array": ("the recipe is an array", header("recipe", [1]), "KvzFormatError"),
    "unknown-codec": ("the codec id is unknown", header("recipe.codec.id", "evil"), "KvzFormatError"),
    "unknown-layout": ("a layout id is unknown", header("recipe.layouts.0.id", "evil"), "KvzFormatError"),
    "dtype-object": ("the dtype is an object", header("dtype", {"bf16": 1}), "KvzFormatError"),
    # the index
    "stored-len-wraps": ("stored lengths that tile the file only modulo 2^64", index_edit(wrapped_lengths, recipe="zstd:1"), "KvzCorruptError"),
    "offset-past-end": ("a chunk offset beyond the end of the file", index_edit(lambda i: i["offset"].__setitem__(3, 1 << 40)), "KvzCorruptError"),
    "raw-len-off-by-one": ("a chunk's raw length one more than its plane", index_edit(lambda i: i["raw_len"].__setitem__(2, i["raw_len"][2] + 1), tile=True), "KvzCorruptError"),
    "records-swapped": ("two index records swapped, offsets retiled", index_edit(swapped_records, tile=True), "KvzCorruptError"),
    "unknown-flag": ("a chunk flag bit no version defines", index_edit(lambda i: i["flags"].__setitem__(0, 4), tile=True), "KvzCorruptError"),
    "raw-flag-lies": ("a compressed chunk flagged as stored raw", index_edit(lambda i: i["flags"].__setitem__(0, FLAG_STORED_RAW), tile=True), "KvzCorruptError"),
    "trailer-count-lies": ("the trailer's chunk count disagrees with the index length", lambda: (lambda p: (p.trailer.update(chunks=10**6), assemble(p))[1])(base()), "KvzCorruptError"),
    # chunks that decode to more than they may
    "zstd-zeros-2x1GiB": ("one layer of 2 x 1 GiB of zeros, a valid file of 66 KB", claim([16, 32768, 1024], 32768, zstd_zeros), "KvzTooLargeError"),
    "claims-1TiB": ("K and V claim 1 TiB each in 8 GiB chunks of one byte", claim([8, 1 << 27, 512], 1 << 20, one_byte), "KvzTooLargeError"),
    "zstd-frame-larger-than-plane": ("a zstd frame of 2 MiB in a 768-byte plane", payload_edit(0, lambda n: zstd_zeros(2 << 20)[0]), "KvzCorruptError"),
    "zstd-frame-hides-size": ("a zstd frame without its content size, of 64 MiB, in a 768-byte plane", payload_edit(0, lambda n: zstandard.ZstdCompressor(write_content_size=False).compress(bytes(64 << 20))), "KvzCorruptError"),
    "lz4-frame-larger-than-plane": ("an lz4 frame of 8 MiB in a 768-byte plane", payload_edit(0, lambda n: lz4.frame.compress(bytes(8 << 20)), "byteplane|lz4"), "KvzCorruptError"),
    "zlib-bomb": ("a zlib stream of 16 MiB in a 768-byte plane", payload_edit(0, lambda n: zlib.compress(bytes(16 << 20), 9), "byteplane|zlib:6"), "KvzCorruptError"),
    "other-bytes-same-size": ("a chunk holding another valid frame of the right size", payload_edit(0, lambda n: zstandard.ZstdCompressor().compress(bytes(n))), "KvzCorruptError"),
    "exphuff-garbage": ("an exphuff chunk of garbage for the native decoder", payload_edit(1, lambda n: bytes(range(256)) * 3, "exphuff"), "KvzCorruptError"),
    "exphuff-zeros": ("an exphuff chunk of zeros, its plane's length", payload_edit(0, lambda n: bytes(n), "exphuff"), "KvzCorruptError"),
    "exphuff-lanes-garbage": ("an exphuff-lanes chunk of garbage after its version byte", payload_edit(1, lambda n: b"\x02" + bytes(range(256)) * 3, "exphuff-lanes:16"), "KvzCorruptError"),
    "exphuff-lanes-wide": ("an exphuff-lanes chunk claiming 65535 symbols per lane", payload_edit(2, lambda n: b"\x02\x00" + bytes(n // 2) + b"\xff\xff" + bytes(64), "exphuff-lanes:16"), "KvzCorruptError"),
    "garbage-chunk": ("a chunk of garbage with a matching stored checksum", payload_edit(5, lambda n: bytes(range(256)) * 2), "KvzCorruptError"),
}


if __name__ == "__main__":
    CORPUS.mkdir(exist_ok=True)
    manifest = {}
    for name, (what, build, error) in CASES.items():
        data = build()
        (CORPUS / f"{name}.kvz").write_bytes(data)
        manifest[name] = {"what": what, "error": error}
        print(f"{name}.kvz: {len(data)} bytes, {what}")
    (HERE / "corpus.json").write_text(json.dumps(manifest, indent=2) + "\n")
