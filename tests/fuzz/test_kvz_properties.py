"""Property tests: .kvz files forged from structured parts, read in the sandbox.

Every file has a valid outer frame (header, index and trailer checksums), so
each reaches the reader's checks of content. Whatever a file holds, reading it
must end in a kvtool ``DecodeError`` or in data, within the bar of
``conftest.py`` (2 s of CPU, 256 MB). Data must agree with the raw checksums
the file records; where the forgery cannot have changed the data (the index,
the trailer, a chunk's stored bytes), it must be the original cache bit for bit.

Each property runs ``KVTOOL_FUZZ_EXAMPLES`` examples (default 60, enough for every
CI run); set it higher for a deeper search.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import lz4.frame
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from limits import MAX_SIZE, assert_bounded, sandbox  # noqa: F401 - sandbox is a fixture
from forge import Parts, Raw, assemble, dissect
from sandbox import digest
from kvtool.cache import KVCache
from kvtool.kvz import encode_cache
from kvtool.kvz.format import FLAG_STORED_RAW, INDEX_DTYPE

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "code.safetensors"
RECIPES = ["exphuff", "byteplane|zstd:1", "channel-major|bf16-split|zlib:1,mant=none", "xor-delta|byteplane|lz4", "none"]
CACHE = KVCache.load(SAMPLE, layers=[0, 29], tokens=slice(0, 40))  # 40 tokens: the last chunk is short
BASES = {recipe: encode_cache(CACHE, recipe, chunk_tokens=16, threads=1) for recipe in RECIPES}
EXPECTED = digest(CACHE)
U64 = (1 << 64) - 1

EXAMPLES = int(os.environ.get("KVTOOL_FUZZ_EXAMPLES", "60"))
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)

edge_ints = st.sampled_from(
    [-(1 << 63), -1, 0, 1, 2, 3, 4, 255, 1 << 20, (1 << 20) + 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32,
     1 << 40, (1 << 53) + 1, (1 << 63) - 1, 1 << 63, U64, 1 << 64, 10**30]
)
hostile_ints = st.one_of(edge_ints, st.integers(-1000, 1 << 21))
nested_raw = st.integers(1, 100_000).map(lambda n: Raw("[" * n + "]" * n))
scalars = st.one_of(
    st.none(), st.booleans(), hostile_ints, st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6), st.sampled_from([Raw("1e400"), Raw("-1e400"), Raw("NaN"), Raw("Infinity")]),
    st.integers(4000, 5000).map(lambda n: Raw("1" * n)),  # past Python's limit on digits in an int
    nested_raw,
)
hostile_json = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6
)


def read(sandbox, tmp_path: Path, blob: bytes) -> dict:
    path = tmp_path / "case.kvz"
    path.write_bytes(blob)
    report = sandbox.run({"op": "read", "path": str(path), "max_size": MAX_SIZE})
    assert_bounded(report)
    event(f"{report['status']} {report.get('type', '')}".strip())  # pytest --hypothesis-show-statistics
    if report["status"] == "error":
        assert report["decode_error"], report
    else:
        assert report["same_by_both_paths"] and report["same_by_rows"], report
        assert report["agrees_with_checksums"], report
    return report


def header_paths(value, prefix=()) -> list[tuple]:
    """Every place in a JSON value, containers included."""
    out = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            out += header_paths(item, prefix + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += header_paths(item, prefix + (i,))
    return out


def replaced(value, path: tuple, new):
    if not path:
        return new
    head, *rest = path
    if isinstance(value, dict):
        return {**value, head: replaced(value[head], tuple(rest), new)}
    return [replaced(v, tuple(rest), new) if i == head else v for i, v in enumerate(value)]


@pytest.fixture
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("forged")


@SETTINGS
@given(recipe=st.sampled_from(RECIPES), data=st.data())
def test_any_header_value(sandbox, tmp, recipe, data):
    parts = dissect(BASES[recipe])
    path = data.draw(st.sampled_from(header_paths(parts.header)), label="path")
    parts.header = replaced(parts.header, path, data.draw(hostile_json, label="value"))
    read(sandbox, tmp, assemble(parts))


@SETTINGS
@given(recipe=st.sampled_from(RECIPES), data=st.data())
def test_any_index_field(sandbox, tmp, recipe, data):
    parts = dissect(BASES[recipe])
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        row = data.draw(st.integers(0, len(parts.index) - 1), label="row")
        name = data.draw(st.sampled_from(INDEX_DTYPE.names), label="field")
        bits = INDEX_DTYPE[name].itemsize * 8
        value = data.draw(st.one_of(edge_ints, st.integers(0, 1 << 16)), label="value") % (1 << bits)
        parts.index[row][name] = value
    report = read(sandbox, tmp, assemble(parts, tile=data.draw(st.booleans(), label="retile")))
    if report["status"] == "ok":
        assert report["digest"] == EXPECTED


@SETTINGS
@given(recipe=st.sampled_from(RECIPES), data=st.data())
def test_any_index_order_and_trailer(sandbox, tmp, recipe, data):
    parts = dissect(BASES[recipe])
    rows = data.draw(st.lists(st.integers(0, len(parts.index) - 1), max_size=len(parts.index) + 2), label="rows")
    parts.index, parts.chunks = parts.index[rows], [parts.chunks[r] for r in rows]
    if data.draw(st.booleans(), label="trailer"):
        field = data.draw(st.sampled_from(["index_offset", "index_len", "chunks", "header_len"]), label="field")
        parts.trailer[field] = data.draw(edge_ints, label="value") % (1 << 64)
    report = read(sandbox, tmp, assemble(parts))
    if report["status"] == "ok":
        assert report["digest"] == EXPECTED


def frames(raw_len: int):
    """Chunk payloads a hostile writer would try: other sizes, bombs, garbage, truncations."""
    sizes = st.sampled_from([0, 1, raw_len - 1, raw_len, raw_len + 1, 1 << 20, 16 << 20, 200 << 20])
    return st.one_of(
        st.binary(max_size=2 * raw_len),
        sizes.map(lambda n: zstandard.ZstdCompressor(level=1).compress(bytes(n))),
        sizes.map(lambda n: zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(n))),
        sizes.map(lambda n: lz4.frame.compress(bytes(n))),
        sizes.map(lambda n: zlib.compress(bytes(n), 9)),
        sizes.map(lambda n: zstandard.ZstdCompressor(level=1).compress(bytes(n))).flatmap(
            lambda f: st.integers(0, len(f)).map(lambda cut: f[:cut])
        ),
    )


@SETTINGS
@given(recipe=st.sampled_from(RECIPES), data=st.data())
def test_any_chunk_payload(sandbox, tmp, recipe, data):
    parts = dissect(BASES[recipe])
    row = data.draw(st.integers(0, len(parts.index) - 1), label="row")
    parts.chunks[row] = data.draw(frames(int(parts.index[row]["raw_len"])), label="payload")
    parts.index["flags"][row] = data.draw(st.sampled_from([0, FLAG_STORED_RAW]), label="flags")
    report = read(sandbox, tmp, assemble(parts))
    if report["status"] == "ok":  # every reader verifies each chunk's raw checksum
        assert report["digest"] == EXPECTED


@SETTINGS
@given(
    heads=st.sampled_from([1, 8, 1 << 10, 1 << 14]),
    dim=st.sampled_from([1, 64, 1 << 10, 1 << 14]),
    tokens=st.one_of(st.integers(0, 64), edge_ints.filter(lambda n: 0 <= n < 1 << 32)),
    chunk_tokens=st.one_of(st.integers(1, 16), st.sampled_from([1 << 16, 1 << 20])),
    layers=st.integers(1, 3),
    payload=st.sampled_from(["tiny", "zeros"]),
)
def test_any_claimed_size(sandbox, tmp, heads, dim, tokens, chunk_tokens, layers, payload):
    """Headers claiming any size, with an index that agrees chunk for chunk: refused or decoded, never allocated blindly."""
    blocks = -(-tokens // chunk_tokens)
    assume(2 * layers * blocks <= 2048 and heads * dim * 2 <= 1 << 30)
    parts = dissect(BASES["zstd:1"] if "zstd:1" in BASES else encode_cache(CACHE, "zstd:1", chunk_tokens=4, threads=1))
    parts.header["tensors"] = [{"kind": k, "layer": layer, "shape": [heads, tokens, dim]} for layer in range(layers) for k in "kv"]
    parts.header["chunk_tokens"] = chunk_tokens
    records, chunks = [], []
    for tensor in range(2 * layers):
        for start in range(0, tokens, chunk_tokens):
            count = min(chunk_tokens, tokens - start)
            raw_len = heads * count * dim * 2
            stored = zstandard.ZstdCompressor(level=1).compress(bytes(min(raw_len, 1 << 20))) if payload == "zeros" else b"\0"
            chunks.append(stored)
            records.append((tensor, 0, 0, start, count, 0, len(stored), raw_len, 0, 0))
    parts.index, parts.chunks = np.array(records, dtype=INDEX_DTYPE), chunks
    read(sandbox, tmp, assemble(parts))


@settings(max_examples=max(1, EXAMPLES * 2 // 3), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(["bf16", "fp16", "fp32"]),
    shape=st.tuples(st.integers(1, 3), st.integers(0, 20), st.integers(1, 16)),
    layers=st.lists(st.integers(0, 100), min_size=1, max_size=3, unique=True),
    chunk_tokens=st.integers(1, 8),
    recipe=st.sampled_from(["exphuff", "zstd:1", "byteplane|zlib:1", "channel-major|byteplane|lz4", "xor-delta|zstd:3", "none"]),
    seed=st.integers(0, 1 << 32),
)
def test_valid_files_decode_exactly(sandbox, tmp, dtype, shape, layers, chunk_tokens, recipe, seed):
    """Files written from structured parts (shapes, dtypes, layer ids, chunking, recipes): exact data."""
    from kvtool.cache import DTYPES

    rng = np.random.default_rng(seed)
    np_dtype = DTYPES[dtype].numpy

    def tensor():
        return rng.integers(0, 256, size=shape[0] * shape[1] * shape[2] * np_dtype.itemsize, dtype=np.uint8).view(np_dtype).reshape(shape)

    cache = KVCache([tensor() for _ in layers], [tensor() for _ in layers], layer_ids=layers, token_start=int(seed % 1000))
    report = read(sandbox, tmp, encode_cache(cache, recipe, chunk_tokens=chunk_tokens, threads=1))
    assert report["status"] == "ok" and report["digest"] == digest(cache), report


def test_the_batch_read_checks_raw_checksums(sandbox, tmp):
    parts = dissect(BASES["exphuff"])
    assert parts.index["flags"][0] == 0  # a coded chunk, decoded by the native core
    parts.index["raw_xxh3"][0] ^= 1
    path = tmp / "raw.kvz"
    path.write_bytes(assemble(parts))
    report = sandbox.run({"op": "read", "path": str(path), "max_size": MAX_SIZE})
    assert report["ops"]["verify"]["type"] == "KvzCorruptError"  # verify(full=True) checks it
    assert report["status"] == "error" and report["type"] == "KvzCorruptError", report
