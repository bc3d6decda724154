"""The cache model's file and slicing rules: one reading of a token range everywhere, a streamed save."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

import kvtool
from kvtool import kvz
from kvtool.cache import KVCache
from kvtool.errors import UsageError


@pytest.fixture(scope="module")
def small(samples) -> KVCache:
    return KVCache.load(samples[0], layers=[0, 1, 2], tokens=slice(0, 40))


@pytest.fixture(scope="module", params=["bf16", "fp8_e4m3"])
def files(request, small, tmp_path_factory) -> dict[str, object]:
    """The same cache as a safetensors file and a .kvz file, in bf16 and in fp8 (fp8 is read through a memory map)."""
    cache = small
    if request.param == "fp8_e4m3":
        convert = lambda arrays: [a.astype(np.float32).astype(ml_dtypes.float8_e4m3fn) for a in arrays]  # noqa: E731
        cache = KVCache(convert(small.keys), convert(small.values), small.model, small.provenance, small.layer_ids, small.token_start)
    folder = tmp_path_factory.mktemp(request.param)
    cache.save(folder / "c.safetensors")
    kvtool.save(cache, folder / "c.kvz", recipe="zstd:1", chunk_tokens=16)
    return {"cache": cache, "safetensors": folder / "c.safetensors", "kvz": folder / "c.kvz"}


def _readers(files):
    """Every way to read a token range: in memory, from safetensors, from a .kvz, through the API."""
    return {
        "select": lambda tokens: files["cache"].select(tokens=tokens),
        "safetensors": lambda tokens: KVCache.load(files["safetensors"], tokens=tokens),
        "kvz": lambda tokens: kvz.open_kvz(files["kvz"]).read(tokens=tokens),
        "api": lambda tokens: kvtool.load(files["kvz"], tokens=tokens),
    }


@pytest.mark.parametrize("tokens, expected", [
    (slice(5, 21), (5, 21)), (slice(None, 7), (0, 7)), (slice(33, None), (33, 40)),
    (slice(30, 9999), (30, 40)), (slice(12, 4), (12, 12)), (slice(50, 60), (40, 40)), (slice(3, 9, 1), (3, 9)),
])
def test_every_reader_takes_a_token_range_alike(files, tokens, expected):
    start, stop = expected
    whole = files["cache"]
    for name, read in _readers(files).items():
        got = read(tokens)
        assert (got.token_start, got.num_tokens) == (start, stop - start), name
        for a, b in zip(got.keys + got.values, whole.keys + whole.values):
            assert np.array_equal(a.view(np.uint8), b[:, start:stop].view(np.uint8)), name


@pytest.mark.parametrize("tokens, message", [
    (slice(0, 20, 2), "contiguous"), (slice(None, None, -1), "contiguous"),
    (slice(-5, None), "position >= 0"), (slice(0, -1), "position >= 0"), (slice(-(1 << 70), 3), "position >= 0"),
])
def test_every_reader_refuses_a_step_or_a_negative_position(files, tokens, message):
    for name, read in _readers(files).items():
        with pytest.raises(UsageError, match=message):
            read(tokens)


def test_save_writes_safetensors_bytes_with_a_sorted_header(small, tmp_path):
    path = tmp_path / "c.safetensors"
    small.select(layers=[2, 0], tokens=slice(3, 30)).save(path)  # non-contiguous views, layers out of order
    data = path.read_bytes()
    (length,) = struct.unpack_from("<Q", data)
    text = data[8 : 8 + length]
    assert length % 8 == 0 and text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":")).encode().ljust(length)
    with safe_open(str(path), framework="numpy") as f:  # safetensors' own reader checks offsets and lengths
        assert sorted(f.keys()) == ["layer.0.key", "layer.0.value", "layer.2.key", "layer.2.value"]
        assert f.get_slice("layer.2.value").get_dtype() == "BF16"
        assert np.array_equal(f.get_tensor("layer.2.value").view(np.uint16), small.values[2][:, 3:30].view(np.uint16))
    again = tmp_path / "again.safetensors"
    KVCache.load(path).save(again)
    assert again.read_bytes() == data


def test_layouts_codecs_and_stats_do_not_import_the_cache_model():
    code = "import sys, kvtool.layouts.base, kvtool.layouts.float_split, kvtool.layouts.sign_exponent, kvtool.stats, kvtool.codecs.exphuff; print('kvtool.cache' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
