"""The .kvz container on real sample caches: round trips, random access, corruption, safety."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtool import kvz
from kvtool.cache import KVCache
from kvtool.codecs import registry as codec_registry
from kvtool.recipe import recipe_for
from kvtool.kvz import KvzCorruptError, KvzFormatError, decode_cache, encode_cache, open_kvz
from kvtool.kvz.format import FLAG_STORED_RAW
from kvtool.layouts.base import PlaneSpec
from kvtool.errors import DecodeError, UsageError
from kvtool.recipe import Recipe
from kvtool.testing import require_available

RECIPES = [
    "none",
    "zstd:3",
    "byteplane|zstd:1",
    "channel-major|byteplane|zstd:1,lo=none",
    "channel-major|bf16-split|zstd:1",
    "xor-delta|byteplane|lz4",
    "channel-major|xor-delta|byteplane|zlib:1",
    "byteplane|qat",
    "byteplane|isal:1",
    "exphuff",
    "token-major|exphuff",
]


@pytest.fixture(scope="module")
def small(samples) -> KVCache:
    """Three layers, 70 tokens (not a multiple of the chunk size) of the first real sample."""
    return KVCache.load(samples[0], layers=[0, 7, 29], tokens=slice(0, 70))


@pytest.mark.parametrize("codec_id", sorted(codec_registry.ids()))
def test_every_codec_round_trips_every_sample(samples, tmp_path, codec_id):
    require_available(recipe_for(codec_id))
    for sample in samples:
        cache = KVCache.load(sample)
        path = tmp_path / f"{sample.stem}.kvz"
        kvz.save(cache, path, recipe_for(codec_id))
        with open_kvz(path) as reader:
            reader.verify(full=True)
            assert reader.read().equal_bits(cache)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("chunk_tokens", [16, 256])
def test_recipes_round_trip(small, recipe, chunk_tokens):
    require_available(recipe)
    blob = encode_cache(small, recipe, chunk_tokens=chunk_tokens, threads=2)
    decoded = decode_cache(blob)
    assert decoded.equal_bits(small)
    assert decoded.model == small.model and decoded.provenance == small.provenance


def test_random_access_reads_only_needed_chunks(samples, tmp_path):
    cache = KVCache.load(samples[0])
    path = tmp_path / "c.kvz"
    kvz.save(cache, path, "byteplane|zstd:1", chunk_tokens=64)
    full = kvz.open_kvz(path).read()
    for layers, tokens in [([7], None), (None, slice(0, 128)), ([3, 4], slice(70, 130))]:
        with open_kvz(path) as reader:
            metadata_bytes = reader.bytes_read
            part = reader.read(layers=layers, tokens=tokens)
            wanted_tensors = {t for t, (layer, _, _) in enumerate(reader.tensors) if layers is None or layer in layers}
            lo, hi = (tokens.start, tokens.stop) if tokens else (0, reader.num_tokens)
            needed = [
                e for e in reader.index
                if e["tensor"] in wanted_tensors and e["token_start"] < hi and e["token_start"] + e["token_count"] > lo
            ]
            assert reader.bytes_read - metadata_bytes == sum(int(e["stored_len"]) for e in needed)
            assert reader.bytes_read < 0.6 * os.path.getsize(path)
        assert part.equal_bits(full.select(layers=layers, tokens=tokens))


def test_every_single_byte_change_is_caught(small):
    one = small.select(layers=[7], tokens=slice(0, 9))
    blob = encode_cache(one, "channel-major|byteplane|zstd:1", chunk_tokens=4)
    for pos in range(len(blob)):
        corrupt = bytearray(blob)
        corrupt[pos] ^= 0xFF
        with pytest.raises(DecodeError):
            decode_cache(bytes(corrupt))


def test_truncation_and_trailing_bytes(small):
    blob = encode_cache(small, "byteplane|zstd:1")
    for cut in (0, 7, 16, len(blob) // 2, len(blob) - 1):
        with pytest.raises(KvzCorruptError if cut >= 8 else DecodeError):
            decode_cache(blob[:cut])
    with pytest.raises(KvzCorruptError):
        decode_cache(blob + b"\0")


def test_not_kvz_and_future_version(small):
    blob = bytearray(encode_cache(small, "zstd:1"))
    with pytest.raises(KvzFormatError, match="not a .kvz"):
        decode_cache(b"PK\x03\x04" + bytes(200))
    struct.pack_into("<I", blob, 8, 2)
    with pytest.raises(KvzFormatError, match="version 2"):
        decode_cache(bytes(blob))


def test_header_naming_unknown_codec_is_refused(small):
    """A file naming a codec this kvtool does not have fails cleanly and imports nothing."""
    blob = encode_cache(small, "zstd:1")
    header = bytes(blob[16 : 16 + struct.unpack_from("<I", blob, 12)[0]])
    assert b'"id":"zstd"' in header
    evil = _rewrite_header(blob, header.replace(b'"id":"zstd"', b'"id":"evil"'))
    with pytest.raises(KvzFormatError, match="unknown codec 'evil'"):
        decode_cache(evil)


def _rewrite_header(blob: bytes, header: bytes) -> bytes:
    """A well-formed file with another header of the same length (checksums recomputed)."""
    import xxhash

    blob = bytearray(blob)
    h = struct.unpack_from("<I", blob, 12)[0]
    assert len(header) == h
    blob[16 : 16 + h] = header
    fields = list(struct.unpack_from("<6Q", blob, len(blob) - 64))
    fields[4] = xxhash.xxh3_64_intdigest(header)
    struct.pack_into("<6Q", blob, len(blob) - 64, *fields)
    struct.pack_into("<Q", blob, len(blob) - 16, xxhash.xxh3_64_intdigest(struct.pack("<6Q", *fields)))
    return bytes(blob)


def test_sizes_report(small):
    reader = kvz.KvzReader.from_bytes(encode_cache(small, "byteplane|zstd:1"))
    sizes = reader.sizes()
    assert sizes["total"]["raw"] == small.nbytes
    assert sizes["total"]["stored"] == int(reader.index["stored_len"].sum())
    assert set(sizes["by_plane"]) == {"hi", "lo"} and set(sizes["by_kind"]) == {"k", "v"}
    assert set(sizes["by_layer"]) == {0, 7, 29}
    assert sizes["by_plane"]["hi"]["ratio"] > sizes["by_plane"]["lo"]["ratio"]


def test_incompressible_planes_are_stored_raw(small):
    reader = kvz.KvzReader.from_bytes(encode_cache(small, "byteplane|zstd:1"))
    raw = (reader.index["flags"] & FLAG_STORED_RAW) != 0
    assert np.all(reader.index["stored_len"][raw] == reader.index["raw_len"][raw])
    assert np.all(reader.index["stored_len"][~raw] < reader.index["raw_len"][~raw])


def test_interrupted_save_leaves_nothing(small, tmp_path):
    target = tmp_path / "out.kvz"

    def boom(_):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        kvz.save(small, target, "byteplane|zstd:1", on_progress=boom)
    assert list(tmp_path.iterdir()) == []


def test_user_metadata_is_kept_apart(small, tmp_path):
    path = tmp_path / "m.kvz"
    kvz.save(small, path, "zstd:1", metadata={"session": "abc"})
    with open_kvz(path) as reader:
        assert reader.metadata == {"session": "abc"}
    with pytest.raises(UsageError):
        kvz.save(small, path, "zstd:1", metadata={"n": 1})


def test_empty_and_single_token_caches(small):
    for tokens in (slice(0, 0), slice(5, 6)):
        part = small.select(tokens=tokens)
        assert decode_cache(encode_cache(part, "channel-major|byteplane|zstd:1")).equal_bits(part)


def test_recipe_errors_name_the_stage():
    with pytest.raises(UsageError, match="'byteplane' is a layout"):
        Recipe.parse("channel-major|byteplane")
    with pytest.raises(UsageError, match="unknown layout 'chanel-major'"):
        Recipe.parse("chanel-major|zstd:1")
    with pytest.raises(UsageError, match="level must be"):
        Recipe.parse("byteplane|zstd:99")
    with pytest.raises(UsageError, match="names planes"):
        Recipe.parse("byteplane|zstd:1,mant=none").plan(PlaneSpec("data", (3, 4, 64), np.dtype("<u2")))


def test_recipe_spec_and_config_round_trip():
    for spec in RECIPES:
        recipe = Recipe.parse(spec)
        assert Recipe.parse(recipe.spec()) == recipe
        assert Recipe.from_config(recipe.to_config()) == recipe


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_files_decode_exactly_or_fail_cleanly(small, data):
    """Mutations, truncations and splices of a real .kvz: a correct decode or a documented error, nothing else."""
    one = small.select(layers=[0, 7], tokens=slice(0, 20))
    blob = encode_cache(one, data.draw(st.sampled_from(["byteplane|zstd:1", "channel-major|bf16-split|zlib:1", "none"])), chunk_tokens=8)
    other_cache = small.select(layers=[29], tokens=slice(0, 20))
    other = encode_cache(other_cache, "byteplane|zstd:1", chunk_tokens=8)
    kind = data.draw(st.sampled_from(["flip", "truncate", "splice", "overwrite"]))
    mutated = bytearray(blob)
    if kind == "flip":
        for pos in data.draw(st.lists(st.integers(0, len(blob) - 1), min_size=1, max_size=4)):
            mutated[pos] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        mutated = mutated[: data.draw(st.integers(0, len(blob) - 1))]
    elif kind == "splice":
        cut = data.draw(st.integers(0, len(blob)))
        mutated = mutated[:cut] + bytearray(other[data.draw(st.integers(0, len(other))) :])
    else:
        pos = data.draw(st.integers(0, len(blob) - 1))
        chunk = data.draw(st.binary(min_size=1, max_size=64))
        mutated[pos : pos + len(chunk)] = chunk
    try:
        decoded = decode_cache(bytes(mutated))
    except DecodeError:
        return
    # Only an unchanged file, or a splice that copied the other file whole, is a valid .kvz.
    assert decoded.equal_bits(one) or (bytes(mutated) == other and decoded.equal_bits(other_cache))


@pytest.mark.parametrize("recipe", ["exphuff", "byteplane|zstd:1"])
def test_read_rows_of_a_cache_without_tokens_places_nothing(small, recipe):
    empty = small.select(tokens=slice(0, 0))
    target = np.full(16, 7, np.uint8)
    with kvz.KvzReader.from_bytes(encode_cache(empty, recipe)) as reader:
        reader.read_rows([target], np.zeros((6, 3, 0), np.int64), [0] * 6)
    assert (target == 7).all()


@pytest.mark.parametrize("recipe", ["byteplane|zstd:1", "exphuff"])
def test_full_verify_reads_each_chunk_once(small, tmp_path, recipe):
    path = tmp_path / "c.kvz"
    kvz.save(small, path, recipe, chunk_tokens=16)
    with kvz.open_kvz(path) as reader:
        before = reader._source.bytes_read
        progress = []
        reader.verify(full=True, on_progress=progress.append)
        assert reader._source.bytes_read - before == int(reader.index["stored_len"].sum())
        assert sum(progress) == int(reader.index["raw_len"].sum())
