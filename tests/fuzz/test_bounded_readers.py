"""Readers bounded by their input: a block that expands too far is refused before anything is
allocated for it, ``verify --full`` checks what decoding checks, errors say where, and
``decompress`` streams its output one block at a time."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from forge import assemble, dissect
from make_corpus import claim, zstd_zeros
from kvtool.cache import KVCache
from kvtool.cli import app
from kvtool.errors import DecodeError
from kvtool.kvz import KvzCorruptError, KvzReader, KvzTooLargeError, encode_cache
from kvtool.kvz.extract import extract_safetensors

#: One layer whose K and V are 2 MiB of zeros each, in one zstd chunk of about a hundred bytes.
ZEROS = claim([4, 4096, 64], 4096, zstd_zeros)


def read_rows(reader: KvzReader) -> np.ndarray:
    heads, tokens, dim = reader.tensors[0][2]
    count, row = 2 * len(reader.layer_ids), dim * reader.dtype.itemsize
    target = np.zeros(count * heads * tokens * row, np.uint8)
    reader.read_rows([target], (np.arange(count * heads * tokens, dtype=np.int64) * row).reshape(count, heads, tokens), [0] * count)
    return target


@pytest.mark.parametrize("op", ["read", "read_rows", "verify"])
def test_a_block_that_expands_too_far_is_refused_with_where_and_why(op):
    blob = ZEROS()
    with KvzReader.from_bytes(blob) as reader:
        with pytest.raises(KvzTooLargeError) as caught:
            {"read": reader.read, "read_rows": lambda: read_rows(reader), "verify": lambda: reader.verify(full=True)}[op]()
        reader.verify()  # the checksums alone decode nothing: still fine
    error = caught.value
    assert (error.cause, error.chunk, error.layer, error.kind) == ("too_large", 0, 0, "k")
    assert "--max-expansion" in str(error)


def test_a_caller_who_trusts_the_file_raises_the_limit(tmp_path):
    blob = ZEROS()
    with KvzReader.from_bytes(blob, max_expansion=1 << 20) as reader:
        cache = reader.read()
        reader.verify(full=True)
        assert not read_rows(reader).any()
    assert all(not a.any() for _, _, a in cache.tensors()) and cache.nbytes == 4 << 20
    path = tmp_path / "zeros.kvz"
    path.write_bytes(blob)
    runner = CliRunner()
    for args in (["verify", str(path), "--full"], ["decompress", str(path), str(tmp_path / "out.safetensors")]):
        refused = runner.invoke(app, args)
        assert refused.exit_code == 4 and "over 1024 times" in refused.output, refused.output
        assert runner.invoke(app, [*args, "--max-expansion", "1000000"]).exit_code == 0
    assert KVCache.load(tmp_path / "out.safetensors").equal_bits(cache)


def test_verify_full_fails_where_decoding_fails(tmp_path):
    """A file whose tensors claim zero heads: whatever decoding makes of it, verify --full makes the same."""
    build = claim([0, 64, 64], 64, lambda raw_len: (b"\x00" * 8, 0), recipe="exphuff")
    outcomes = []
    for op in ("read", "verify"):
        try:
            with KvzReader.from_bytes(build()) as reader:
                reader.read() if op == "read" else reader.verify(full=True)
            outcomes.append("ok")
        except DecodeError as exc:
            outcomes.append(type(exc).__name__)
    assert outcomes == ["KvzFormatError", "KvzFormatError"]  # refused as the header is validated, on every path
    path = tmp_path / "no-heads.kvz"
    path.write_bytes(build())
    runner = CliRunner()
    verify = runner.invoke(app, ["verify", str(path), "--full"])
    decompress = runner.invoke(app, ["decompress", str(path), str(tmp_path / "out.safetensors")])
    assert verify.exit_code == decompress.exit_code == (0 if outcomes[0] == "ok" else 4), (verify.output, decompress.output)


@pytest.mark.parametrize("recipe", ["exphuff", "byteplane|zstd:1", "int:4|zstd:3"])
def test_a_damaged_chunk_names_its_chunk_layer_and_kind(samples, recipe):
    cache = KVCache.load(samples[0], layers=[0, 7], tokens=slice(0, 100))
    parts = dissect(encode_cache(cache, recipe, chunk_tokens=32, threads=1))
    row = int(np.flatnonzero((parts.index["tensor"] == 3) & (parts.index["token_start"] == 64))[0])
    parts.chunks[row] = bytes([parts.chunks[row][0] ^ 1]) + parts.chunks[row][1:]
    blob = assemble(parts, stored_hashes=False)
    for op in ("read", "read_rows", "verify"):
        with KvzReader.from_bytes(blob) as reader, pytest.raises(KvzCorruptError) as caught:
            {"read": reader.read, "read_rows": lambda: read_rows(reader), "verify": lambda: reader.verify(full=True)}[op]()
        assert (caught.value.cause, caught.value.chunk, caught.value.layer, caught.value.kind) == ("damaged", row, 7, "v"), op


@pytest.mark.parametrize("recipe", ["exphuff", "channel-major|byteplane|zstd:1", "int:4|zstd:3"])
@pytest.mark.parametrize("selection", [{}, {"layers": [7], "tokens": slice(10, 75)}])
def test_streamed_decompress_writes_what_read_and_save_write(samples, tmp_path, recipe, selection):
    cache = KVCache.load(samples[0], layers=[0, 7, 29], tokens=slice(0, 90))
    with KvzReader.from_bytes(encode_cache(cache, recipe, chunk_tokens=32, threads=1)) as reader:
        reader.read(**selection).save(tmp_path / "whole.safetensors")
        written = extract_safetensors(reader, tmp_path / "streamed.safetensors", threads=2, **selection)
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    assert written.num_tokens == (65 if selection else 90)


@pytest.mark.parametrize("recipe", ["channel-major|byteplane|zstd:1", "int:4,group=64|zstd:3", "ctxans"])
def test_rows_decode_without_a_cache_in_between(samples, recipe):
    """``read_rows`` allocates about a block beyond its caller's targets, not a decoded cache."""
    import tracemalloc

    cache = KVCache.load(samples[0])
    with KvzReader.from_bytes(encode_cache(cache, recipe, chunk_tokens=64, threads=1)) as reader:
        heads, tokens, dim = reader.tensors[0][2]
        count, row = 2 * len(reader.layer_ids), dim * reader.dtype.itemsize
        target = np.zeros(count * heads * tokens * row, np.uint8)
        rows = (np.arange(count * heads * tokens, dtype=np.int64) * row).reshape(count, heads, tokens)
        tracemalloc.start()
        try:
            reader.read_rows([target], rows, [0] * count)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # a cache in between costs its whole size; a block and a codec's working memory (the numpy
        # reference of ctxans holds a few MiB of its own) stay well under half of it
        assert peak < cache.nbytes // 2, (peak, cache.nbytes)
        assert target.tobytes() == b"".join(a.tobytes() for _, _, a in reader.read().tensors())
