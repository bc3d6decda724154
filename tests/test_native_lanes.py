"""exphuff-lanes (exphuff chunk version 2): the C core and the numpy reference write and read the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
from float_blocks import float_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool import _native
from kvtool._native import lanes_reference, reference
from kvtool.cache import KVCache
from kvtool.codecs import get_codec
from kvtool.kvz import decode_cache, encode_cache
from kvtool.errors import DecodeError, UsageError

from native_checks import needs_core

core = _native.core()


def native_encode(block: np.ndarray, name: str, lane: int) -> bytes:
    contiguous = np.ascontiguousarray(block)
    return core.exphuff_encode(contiguous.reshape(-1).view(np.uint8), _native.DTYPE_CODES[name], *block.shape, lane)


def native_decode(chunk: bytes, name: str, shape) -> tuple[int, np.ndarray]:
    out = np.zeros(shape, f"u{reference.FAMILIES[name].width}")
    return core.exphuff_decode(chunk, out.reshape(-1).view(np.uint8), _native.DTYPE_CODES[name], *shape), out


def bits(block: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(block).view(f"u{block.itemsize}")


@needs_core
@settings(max_examples=200, deadline=None)
@given(float_blocks(), st.sampled_from([16, 17, 64, 512]))
def test_native_and_reference_write_and_read_the_same_lane_chunks(case, lane):
    name, block = case
    chunk = lanes_reference.encode(block, name, lane)
    assert native_encode(block, name, lane) == chunk
    status, out = native_decode(chunk, name, block.shape)
    assert status == 0 and np.array_equal(out, bits(block))
    assert np.array_equal(lanes_reference.decode(chunk, name, block.shape), bits(block))


@needs_core
@pytest.mark.parametrize("lane, bound", [(16, 1.2), (512, 1.01), (16384, 1.01)])
def test_samples_code_the_same_and_cost_little_ratio(samples, lane, bound):
    """On the real caches: the same bytes from both encoders, and from 512 symbols per lane within 1% of exphuff's size."""
    for path in samples:
        cache = KVCache.load(path, layers=[0, 7, 29])
        for _, _, block in cache.tensors():
            chunk = native_encode(block, "bf16", lane)
            assert chunk == lanes_reference.encode(block, "bf16", lane)
            assert np.array_equal(native_decode(chunk, "bf16", block.shape)[1], bits(block))
            assert len(chunk) < bound * len(reference.encode(block, "bf16"))


@needs_core
def test_a_damaged_lane_chunk_is_refused_by_both_decoders(samples):
    block = KVCache.load(samples[0], layers=[3]).keys[0][:, :64]
    chunk = bytearray(lanes_reference.encode(block, "bf16", 64))
    heads, _, dim = block.shape
    lane_at = 2 + heads * dim + block.size
    cases = {
        "truncated": bytes(chunk[:-1]),
        "lane too small": bytes(chunk[:lane_at]) + (15).to_bytes(2, "little") + bytes(chunk[lane_at + 2 :]),
        "longer lane": bytes(chunk) + b"\0",
        "version 1": b"\x01" + bytes(chunk[1:]),
    }
    for what, bad in cases.items():
        assert native_decode(bad, "bf16", block.shape)[0] != 0, what
        with pytest.raises(DecodeError):
            lanes_reference.decode(bad, "bf16", block.shape)


def test_a_file_of_lane_chunks_reads_with_and_without_the_core(samples, monkeypatch):
    cache = KVCache.load(samples[1], layers=[1, 2], tokens=slice(0, 100))
    blob = encode_cache(cache, "exphuff-lanes:64", chunk_tokens=48)
    assert decode_cache(blob).equal_bits(cache)
    monkeypatch.setattr(_native, "core", lambda: None)
    assert decode_cache(blob).equal_bits(cache)
    assert encode_cache(cache, "exphuff-lanes:64", chunk_tokens=48) == blob


def test_the_lane_size_is_checked_and_kept_in_the_config():
    assert get_codec("exphuff-lanes:256").get_config() == {"id": "exphuff-lanes", "lane": 256}
    assert get_codec("exphuff-lanes").lane == lanes_reference.DEFAULT_LANE
    for bad in ("exphuff-lanes:15", "exphuff-lanes:16385", "exphuff-lanes:x"):
        with pytest.raises(UsageError):
            get_codec(bad)


def test_exphuff_refuses_a_lane_chunk_and_back(samples):
    block = KVCache.load(samples[0], layers=[3]).keys[0]
    with pytest.raises(DecodeError):
        get_codec("exphuff").decode_array(get_codec("exphuff-lanes").encode_array(block), block.shape, block.dtype)
    with pytest.raises(DecodeError):
        get_codec("exphuff-lanes").decode_array(get_codec("exphuff").encode_array(block), block.shape, block.dtype)


def test_kvtool_codecs_says_whether_the_gpu_decodes_here_and_why_not():
    import json

    from typer.testing import CliRunner

    from kvtool.cli import app

    rows = {row["id"]: row for row in json.loads(CliRunner().invoke(app, ["codecs", "--json"]).stdout)}
    lanes = rows["exphuff-lanes"]
    assert lanes["available"] and isinstance(lanes["gpu"], bool)
    assert lanes["gpu_implementation"] if lanes["gpu"] else lanes["gpu_reason"]
    text = CliRunner().invoke(app, ["codecs"]).stdout
    assert "GPU decode: " in next(line for line in text.splitlines() if line.startswith("exphuff-lanes"))
