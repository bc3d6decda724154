"""ctxtans chunk version 3 (a rANS state per channel of a group, the lanes of SIMD registers): the core's
kernels for every instruction set (portable, AVX2, AVX-512) against the numpy reference, both ways, on real
and generated blocks, in geometries on and off the SIMD paths, kernels alternated; the raw bits the states
hold; KVTOOL_SIMD.

A kernel this process may not run (the CPU lacks it, or KVTOOL_SIMD holds the core lower) is reported as skipped,
with the level in use; the portable one runs everywhere."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool import _native
from kvtool._native import ctxtans_lanes_reference as lanes_reference
from kvtool._native import ctxtans_reference as reference
from kvtool.cache import KVCache
from kvtool.codecs import get_codec
from kvtool.codecs.ctxtans import tables_of
from kvtool.errors import DecodeError, UsageError
from kvtool.testing.arraycodecs import DTYPES

from float_blocks import kv_values
from native_checks import (CorePaths, assert_same_answer_to_damage, assert_same_chunks, assert_same_file_without_the_core,
                           at_level, levels_here)

core = _native.core()
needs_core = pytest.mark.skipif(core is None, reason=f"native core: {_native.status()}")
DICTIONARY = get_codec("ctxtans").dictionary()
TABLES, MODEL = tables_of(DICTIONARY)


def isa_index(name: str) -> int:
    """The index of instruction set `name`; skips the test where the core is off or this process may not run it."""
    if core is None:
        pytest.skip(f"native core: {_native.status()}")
    index = _native.ISAS.index(name)
    if index not in levels_here():
        pytest.skip(f"this process runs no {name} kernels (the CPU lacks them or KVTOOL_SIMD holds it to {_native.isa_here()})")
    return index


def paths(index: int) -> CorePaths:
    """The core's coders with every kernel at vector level `index`, and the reference's."""
    def native_encode(block, name):
        with at_level(index):
            return core.ctxtans_encode(np.ascontiguousarray(block).reshape(-1).view(np.uint8), MODEL,
                                       _native.DTYPE_CODES[name], *block.shape)

    def native_decode(chunk, name, shape):
        out = np.zeros(shape, f"u{reference.FAMILIES[name].width}")
        with at_level(index):
            return core.ctxtans_decode(chunk, out.reshape(-1).view(np.uint8), MODEL, _native.DTYPE_CODES[name], *shape), out

    return CorePaths(native_encode, native_decode, lambda block, name: reference.encode(block, name, TABLES, DICTIONARY.tag),
                     lambda chunk, name, shape: reference.decode(chunk, name, shape, TABLES, DICTIONARY.tag))


@st.composite
def lane_blocks(draw):
    """Blocks whose heads fill groups of 64 lanes, part of one, several, or part of a SIMD register (dims 8 to
    130), KV-like or few distinct values, some rows repeated; every dtype."""
    name = draw(st.sampled_from(list(reference.FAMILIES)))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 48)), draw(st.sampled_from([8, 24, 32, 48, 64, 70, 96, 128, 130])))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    block = kv_values(rng, shape, few=draw(st.booleans())).astype(DTYPES[name])
    if draw(st.booleans()) and shape[1] > 1:
        for t in rng.integers(1, shape[1], size=shape[1] // 3):
            block[:, t] = block[:, rng.integers(0, t)]
    return name, block


@pytest.mark.parametrize("isa", _native.ISAS)
@settings(max_examples=40, deadline=None)
@given(lane_blocks())
def test_every_kernel_writes_and_reads_the_reference_chunks(isa, case):
    assert_same_chunks(paths(isa_index(isa)), *case)


@pytest.mark.parametrize("isa", _native.ISAS)
@settings(max_examples=60, deadline=None)
@given(lane_blocks(), st.data())
def test_every_kernel_answers_damage_as_the_reference_does(isa, case, data):
    """A damaged chunk is refused by the kernel and the reference, or decoded by both to the same values."""
    assert_same_answer_to_damage(paths(isa_index(isa)), *case, data)


@pytest.mark.parametrize("isa", _native.ISAS)
def test_real_caches_in_every_dtype_and_geometry(isa, samples):
    """256-token blocks of a real cache (the SIMD paths' whole width), cut to heads of several widths."""
    index = isa_index(isa)
    cache = KVCache.load(samples[0], layers=[0, 9, 29])
    for dtype in ("bf16", "fp16", "fp8_e4m3"):
        for array in cache.keys + cache.values:
            values = array.astype(np.float32).astype(DTYPES[dtype])
            for dim in (64, 48, 40):
                assert_same_chunks(paths(index), dtype, np.ascontiguousarray(values[:, :, :dim]))


@needs_core
def test_kernels_called_in_turn_write_and_read_the_same_chunks(samples):
    """Each kernel's bytes do not depend on which kernel ran before it in the process (one of them once did)."""
    cache = KVCache.load(samples[1], layers=[2, 16])
    here = levels_here()
    for array in cache.keys + cache.values:
        block = np.ascontiguousarray(array)
        expected = paths(0).reference_encode(block, "bf16")
        for index in [*here, *reversed(here), *here]:
            assert paths(index).native_encode(block, "bf16") == expected
            status, out = paths(index).native_decode(expected, "bf16", block.shape)
            assert status == 0 and out.tobytes() == block.tobytes()


@needs_core
@pytest.mark.parametrize("version", [1, 2])
def test_chunks_of_older_versions_decode_with_every_model(samples, version):
    block = KVCache.load(samples[1], layers=[4]).keys[0][:, :120]
    chunk = reference.encode(block, "bf16", TABLES, DICTIONARY.tag, version=version)
    for index in levels_here():
        status, out = paths(index).native_decode(chunk, "bf16", block.shape)
        assert status == 0 and np.array_equal(out, block.view(np.uint16))


def test_version_3_codes_each_heads_channels_in_groups_of_64():
    """Dim 70, two heads: each head's channels (in class order) make a group of 64 lanes and one of 6, token by
    token; versions 1 and 2 cut the whole order in groups of 8."""
    layout = reference.LAYOUTS[3]
    assert [(g.start, g.stop) for g in reference.groups(140, 70, layout)] == [(0, 64), (64, 70), (70, 134), (134, 140)]
    order, lanes, steps = reference.coding_order(3, np.arange(140), 70, layout)
    assert (order[: 3 * 64].reshape(3, 64) == np.arange(64) + 140 * np.arange(3)[:, None]).all()
    assert lanes[3 * 64 : 3 * 70].tolist() == [0, 1, 2, 3, 4, 5] * 3
    assert order[3 * 70 : 3 * 70 + 64].tolist() == list(range(70, 134))
    assert steps[: 3 * 70].tolist() == [0] * 64 + [1] * 64 + [2] * 64 + [3] * 6 + [4] * 6 + [5] * 6
    assert [len(g) for g in reference.groups(20, 10, reference.LAYOUTS[2])] == [8, 8, 4]


def test_the_states_hold_the_raw_planes_last_bits(samples, monkeypatch):
    """A block with fewer raw bits than the states hold (640 fp8 e5m2 values, one raw bit each): the raw section
    is empty and the final states give every bit back; a chunk whose states end holding a bit past the plane's
    end (an encoder that started a state from one) is refused by the reference and every kernel."""
    keys = KVCache.load(samples[0], layers=[5]).keys[0]
    block = np.ascontiguousarray(keys[:1, :10, :64]).astype(np.float32).astype(DTYPES["fp8_e5m2"])
    chunk = reference.encode(block, "fp8_e5m2", TABLES, DICTIONARY.tag)
    head = reference.HEAD.unpack_from(chunk)
    assert head[:2] == (3, reference.MODE_DICT) and len(chunk) == reference.HEAD.size + head[6] * 2 + head[7]
    assert np.array_equal(reference.decode(chunk, "fp8_e5m2", block.shape, TABLES, DICTIONARY.tag), block.view(np.uint8))
    for index in levels_here() if core else ():
        assert paths(index).native_decode(chunk, "fp8_e5m2", block.shape)[1].tobytes() == block.tobytes()
    encode = lanes_reference.encode

    def start_state_63_from_its_last_bit(steps, syms, models, lanes, initial, g, cum):  # bit 1919 of the plane's tail
        return encode(steps, syms, models, lanes, initial[:-1] + [initial[-1] | 1 << (lanes_reference.HELD_PER_STATE - 1)], g, cum)

    monkeypatch.setattr(lanes_reference, "encode", start_state_63_from_its_last_bit)
    damaged = reference.encode(block, "fp8_e5m2", TABLES, DICTIONARY.tag)
    with pytest.raises(DecodeError, match="final states"):
        reference.decode(damaged, "fp8_e5m2", block.shape, TABLES, DICTIONARY.tag)
    for index in levels_here() if core else ():
        assert paths(index).native_decode(damaged, "fp8_e5m2", block.shape)[0] != 0


@needs_core
def test_kvtool_simd_picks_the_kernels_and_they_write_the_same_file(samples, monkeypatch):
    """KVTOOL_SIMD=scalar runs the portable kernels (a process reports it), and the file it writes is the one
    the best kernels here write."""
    script = "from kvtool import _native; print(_native.isa_here())"
    env = {**os.environ, "KVTOOL_SIMD": "scalar"}
    assert subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout.strip() == "scalar"
    monkeypatch.setenv("KVTOOL_SIMD", "scalar")
    assert_same_file_without_the_core(samples[0], "ctxtans", [1, 20])
    monkeypatch.setenv("KVTOOL_SIMD", "avx9000")
    with pytest.raises(UsageError, match="KVTOOL_SIMD"):
        _native.isa_limit()
