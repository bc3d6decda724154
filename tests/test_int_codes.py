"""``int:...,codes=ctx``: the coded codes plane (kvtool.layouts.int_codes) in C and in its numpy reference, the same
bytes on real samples, round trips of awkward arrays, the packed fallback, and damaged planes refused."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from kvtool import _native
from kvtool.cache import KVCache
from kvtool.errors import DecodeError
from kvtool.kvz import decode_cache, encode_cache
from kvtool.layouts import get_layout
from kvtool.layouts import int_codes as ic
from kvtool.layouts.base import PlaneSpec
from kvtool.layouts.int_quant import IntQuant

from native_checks import needs_core

sys.path.insert(0, str(Path(__file__).parent / "golden"))
from make_golden import LOSSY_RECIPES, chunk_tokens, golden_cache



def native_encode(codes: np.ndarray, bits: int) -> np.ndarray:
    packed = ic.pack(codes, bits)
    plane = np.zeros(ic.plane_size(codes.size, bits), np.uint8)
    assert _native.core().int_codes_encode(packed, plane, *codes.shape, bits) == 0
    return plane


def native_decode(plane: np.ndarray, shape: tuple[int, ...], bits: int) -> np.ndarray | int:
    """The packed codes, or the reason the core refuses the plane."""
    packed = np.zeros(-(-int(np.prod(shape)) * bits // 8), np.uint8)
    status = _native.core().int_codes_decode(plane, packed, *shape, bits)
    return status or packed


def reference_plane(codes: np.ndarray, bits: int) -> np.ndarray:
    return ic.reference_encode(ic.pack(codes, bits), codes.shape, bits, ic.plane_size(codes.size, bits))


def round_trips(codes: np.ndarray, bits: int) -> np.ndarray:
    """The reference plane of ``codes``, after checking that both decoders (and the C encoder) agree with it."""
    plane = reference_plane(codes, bits)
    packed = ic.pack(codes, bits)
    assert np.array_equal(ic.reference_decode(plane, codes.shape, bits), packed)
    if _native.core() is not None:
        assert np.array_equal(native_encode(codes, bits), plane)
        assert np.array_equal(native_decode(plane, codes.shape, bits), packed)
    assert np.array_equal(ic.unpack(packed, codes.size, bits).reshape(codes.shape), codes)
    return plane


def real_codes(path, bits: int):
    """``(kind, codes)`` of real tensors quantized as ``int:bits,group=64`` would: keys per channel, values per token."""
    cache = KVCache.load(path)
    for kind, arrays in (("k", cache.keys), ("v", cache.values)):
        for array in (arrays[2], arrays[17]):
            block = np.ascontiguousarray(array[:, :256])
            layout = IntQuant(bits, group=64).for_kind(kind)
            packed = layout.reference_forward(block)[0]
            yield kind, ic.unpack(packed, block.size, bits).reshape(block.shape)


@needs_core
@pytest.mark.parametrize("bits", range(2, 9))
def test_real_samples_code_alike(samples, bits):
    """C writes the reference's bytes for real keys and values, codes them (not the fallback), and reads them back."""
    for path in samples[:2]:
        for kind, codes in real_codes(path, bits):
            plane = round_trips(codes, bits)
            assert plane[0] == 1, (path, kind, bits)


@pytest.mark.parametrize("bits", range(1, 9))
def test_random_and_degenerate_arrays_round_trip(bits):
    rng = np.random.default_rng(bits)
    top = 1 << bits
    cases = [
        np.zeros((1, 1, 1), np.uint8),
        np.full((2, 3, 5), top - 1, np.uint8),  # all equal
        rng.integers(0, top, (3, 1, 64), dtype=np.uint8),  # one token: the start context only
        rng.integers(0, top, (1, 7, 3), dtype=np.uint8),  # odd sizes
        rng.integers(0, top, (2, 33, 9), dtype=np.uint8),
        np.zeros((2, 0, 8), np.uint8),  # no tokens
        (np.cumsum(rng.integers(0, 2, (3, 200, 16)), axis=1) % top).astype(np.uint8),  # slow drifts: what keys do
    ]
    for codes in cases:
        round_trips(codes, bits)


def test_all_equal_codes_take_a_few_bytes():
    plane = round_trips(np.full((3, 256, 64), 5, np.uint8), 3)
    assert plane[0] == 1 and np.count_nonzero(plane) < 40


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_incompressible_codes_fall_back_to_the_packed_codes(bits):
    codes = np.random.default_rng(0).integers(0, 1 << bits, (2, 64, 32), dtype=np.uint8)
    plane = round_trips(codes, bits)
    packed = ic.pack(codes, bits)
    assert plane[0] == 0 and np.array_equal(plane[1 : 1 + packed.size], packed) and not plane[1 + packed.size :].any()


def test_a_plane_never_grows_past_the_packed_codes_and_its_mode_byte():
    codes = np.random.default_rng(1).integers(0, 8, (3, 100, 64), dtype=np.uint8)
    assert IntQuant(3, codes="ctx").plan_plane(PlaneSpec("data", codes.shape, np.dtype(np.float32)))[0].shape == (
        ic.plane_size(codes.size, 3),)
    assert reference_plane(codes, 3).size == 1 + -(-codes.size * 3 // 8)


# -- damaged and crafted planes -------------------------------------------------------------------


def coded_plane() -> tuple[np.ndarray, tuple[int, ...], int]:
    codes = (np.cumsum(np.random.default_rng(2).integers(-1, 2, (2, 40, 16)), axis=1) % 16).astype(np.uint8)
    plane = reference_plane(codes, 4)
    assert plane[0] == 1
    return plane, codes.shape, 4


def refused(plane: np.ndarray, shape: tuple[int, ...], bits: int) -> str:
    """The reference's words for a plane it refuses; the core refuses it for the same reason."""
    with pytest.raises(DecodeError, match="int codes plane") as caught:
        ic.reference_decode(plane, shape, bits)
    if _native.core() is not None:
        status = native_decode(plane, shape, bits)
        assert isinstance(status, int) and ic.REASONS[status] in str(caught.value)
        with pytest.raises(DecodeError, match=ic.REASONS[status]):
            ic.decode(plane, shape, bits)
    return str(caught.value)


def lengths(plane: np.ndarray) -> tuple[int, int]:
    """The model's and the stream's lengths, after checking the plane has no repeat section."""
    assert not plane[10:14].any()
    return int.from_bytes(plane[2:6].tobytes(), "little"), int.from_bytes(plane[6:10].tobytes(), "little")


def with_lengths(plane: np.ndarray, model: int, stream: int) -> np.ndarray:
    out = plane.copy()
    out[2:6] = np.frombuffer(model.to_bytes(4, "little"), np.uint8)
    out[6:10] = np.frombuffer(stream.to_bytes(4, "little"), np.uint8)
    return out


def test_bad_mode_and_bad_context_bits():
    plane, shape, bits = coded_plane()
    for mode in (2, 255):
        bad = plane.copy()
        bad[0] = mode
        assert "unknown mode" in refused(bad, shape, bits)
    bad = plane.copy()
    bad[1] = bits + 1
    assert "malformed model" in refused(bad, shape, bits)
    assert "unknown mode" in refused(plane[:0], shape, bits)


def test_sizes_out_of_bounds():
    plane, shape, bits = coded_plane()
    model, stream = lengths(plane)
    for m, s in ((model, plane.size), (0xFFFFFFFF, stream), (model, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF)):
        assert "beyond the plane" in refused(with_lengths(plane, m, s), shape, bits)
    assert "beyond the plane" in refused(plane[:9], shape, bits)
    packed = plane.copy()
    packed[:] = 0
    assert "beyond the plane" in refused(packed[:5], shape, bits)  # mode 0 with fewer bytes than the codes


def crafted(model: bytes, stream: bytes, c: int = 0) -> np.ndarray:
    """A mode 1 plane from its parts, with room to spare."""
    header = bytes([1, c]) + len(model).to_bytes(4, "little") + len(stream).to_bytes(4, "little") + bytes(4)
    plane = np.zeros(64 + len(model) + len(stream), np.uint8)
    plane[: 14 + len(model) + len(stream)] = np.frombuffer(header + model + stream, np.uint8)
    return plane


def test_bad_tables():
    """Two-bit codes of one token (the start context only, c = 0: contexts 0 and 1), with tables written by hand."""
    codes = np.random.default_rng(4).integers(0, 4, (1, 1, 64), dtype=np.uint8)
    freqs = [None, [1000, 1000, 1000, 1096]]
    stream = ic._rans_encode(codes.astype(np.int64), 2, 0, freqs, np.ones((1, 1), bool))
    good = b"\x02\x0f" + b"\xe8\x07" * 3  # context 1; symbols 0-3; three frequencies of 1000
    assert good == ic._model(freqs, 2)
    assert np.array_equal(ic.reference_decode(crafted(good, stream), codes.shape, 2), ic.pack(codes, 2))
    for model in (
        b"\x06\x0f" + b"\xe8\x07" * 3,  # a context past the last one
        b"\x02\x00",  # a context without symbols
        b"\x02\x1f" + b"\xe8\x07" * 4,  # a symbol past the last one
        b"\x02\x0f\x00" + b"\xe8\x07" * 2,  # a frequency of 0
        b"\x02\x0f\x85\x00" + b"\xe8\x07" * 2,  # a varint with a needless zero byte
        b"\x02\x0f\x80\x80\x01" + b"\xe8\x07" * 2,  # a varint of three bytes
        b"\x02\x0f\x80\x20" + b"\xe8\x07" * 2,  # a frequency of 4096
        b"\x02\x0f" + b"\xd0\x0f" * 3,  # frequencies past 4096 together
        good[:-1],  # cut short
        good + b"\x00",  # a byte too many
    ):
        assert "malformed model" in refused(crafted(model, stream), codes.shape, 2), model
    # a well-formed model without the context the codes need
    assert "malformed stream" in refused(crafted(b"\x01\x0f" + b"\xe8\x07" * 3, stream), codes.shape, 2)


def test_truncated_and_damaged_streams():
    plane, shape, bits = coded_plane()
    model, stream = lengths(plane)
    for cut in (1, 4, stream - 16, stream - 1, stream):
        bad = with_lengths(plane, model, stream - cut)
        bad[14 + model + stream - cut :] = 0
        assert "malformed" in refused(bad, shape, bits)
    bad = plane.copy()
    bad[14 + model : 14 + model + 4] = 0  # a state below 2**23
    assert "malformed stream" in refused(bad, shape, bits)
    rng = np.random.default_rng(3)
    for at in rng.integers(14 + model, 14 + model + stream, 60):
        bad = plane.copy()
        bad[at] ^= 1 << int(rng.integers(0, 8))
        assert "malformed" in refused(bad, shape, bits)


def test_any_flipped_bit_is_refused():
    """Without a repeat section every byte of a coded plane is checked (header, model, stream, zero tail): one
    flipped bit anywhere is a DecodeError in both decoders. (A repeat distance flipped to another earlier row, or a
    flipped packed code in mode 0, decodes to other codes: the container's chunk checksums catch those, as they do
    for the packed plane.)"""
    plane, shape, bits = coded_plane()
    rng = np.random.default_rng(6)
    for at in rng.integers(0, plane.size, 200):
        bad = plane.copy()
        bad[at] ^= 1 << int(rng.integers(0, 8))
        refused(bad, shape, bits)


def repeating_codes() -> np.ndarray:
    """Rows that repeat one token back and further back, as layer 0's values do (they depend on the token alone)."""
    rng = np.random.default_rng(5)
    vocabulary = rng.integers(0, 8, (5, 32), dtype=np.uint8)
    return np.stack([vocabulary[rng.integers(0, 5, 60)] for _ in range(2)])  # [2 heads, 60 tokens, 32]


def test_repeated_rows_are_named_not_coded():
    codes = repeating_codes()
    plane = round_trips(codes, 3)
    section = int.from_bytes(plane[10:14].tobytes(), "little")
    assert plane[0] == 1 and section > 0
    assert np.count_nonzero(plane) < 14 + section + 5 * 32 * 3  # little more than the section and 5 rows' codes


def test_damaged_repeat_sections():
    codes = repeating_codes()
    plane = round_trips(codes, 3)
    section = int.from_bytes(plane[10:14].tobytes(), "little")
    rows = codes.shape[0] * codes.shape[1]
    bad = plane.copy()
    bad[14] |= 1  # token 0 of head 0 repeats a row before the block
    assert "repeat section" in refused(bad, codes.shape, 3)
    bad = plane.copy()
    bad[10:14] = np.frombuffer((section + 1).to_bytes(4, "little"), np.uint8)  # one byte longer: into the model
    assert "malformed" in refused(bad, codes.shape, 3)
    bad = plane.copy()
    bad[10:14] = np.frombuffer((rows // 8 - 1).to_bytes(4, "little"), np.uint8)  # shorter than its bitmap
    assert "malformed" in refused(bad, codes.shape, 3)
    far = plane.copy()
    far[14 + -(-rows // 8)] = 0x7F  # the first repeat 128 tokens back
    assert "repeat section" in refused(far, codes.shape, 3)


def test_bytes_past_the_end():
    plane, shape, bits = coded_plane()
    bad = plane.copy()
    bad[-1] = 1
    assert "bytes after its end" in refused(bad, shape, bits)
    codes = np.random.default_rng(0).integers(0, 8, (1, 3, 3), dtype=np.uint8)  # 27 bits: the last byte's low 5 unused
    packed = reference_plane(codes, 3)
    assert packed[0] == 0
    bad = packed.copy()
    bad[4] |= 1
    assert "bytes after its end" in refused(bad, codes.shape, 3)


# -- the layout ---------------------------------------------------------------------------------


def test_the_option_is_in_the_spec_only_where_it_is_not_the_default():
    assert get_layout("int:3,group=64,codes=ctx").spec() == "int:3,group=64,codes=ctx"
    assert get_layout("int:3,group=64,codes=packed").spec() == "int:3,group=64"
    assert "codes" not in get_layout("int:3").get_config()
    assert get_layout("int:3,codes=ctx").get_config()["codes"] == "ctx"
    with pytest.raises(Exception, match="codes must be one of"):
        get_layout("int:3,codes=huffman")


@pytest.mark.parametrize("recipe", ["int:3,group=64|zstd:3", "int:4,group=64,kbits=6,vbits=3,layers=k1:8+v14:2|zstd:3"])
def test_the_approximation_is_the_packed_recipes(samples, recipe):
    cache = KVCache.load(samples[1], layers=[0, 1, 14], tokens=slice(0, 300))
    coded = recipe.replace("|", ",codes=ctx|", 1)
    packed_blob, coded_blob = encode_cache(cache, recipe, chunk_tokens=128), encode_cache(cache, coded, chunk_tokens=128)
    assert decode_cache(coded_blob).equal_bits(decode_cache(packed_blob))
    assert len(coded_blob) < len(packed_blob)


def test_the_golden_file_pins_coded_planes():
    """Its recipe codes every block of the golden cache (mode 1), so the file holds the coded format, not the fallback."""
    layout = get_layout(LOSSY_RECIPES["lossy-int3-ctx"].partition("|")[0])
    assert chunk_tokens("lossy-int3-ctx") == 12
    for _, kind, array in golden_cache().tensors():
        assert layout.for_kind(kind).forward_plane(np.ascontiguousarray(array))[0][0] == 1
