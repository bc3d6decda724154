"""The ``outliers`` side channel: lossless alone, exact outliers before ``int``, bounded readers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtool import _native
from kvtool.cache import DTYPES, KVCache
from kvtool.errors import DecodeError, UsageError
from kvtool.kvz import KvzReader, decode_cache, encode_cache
from kvtool.layouts import get_layout, parse_layouts
from kvtool.layouts.base import PlaneSpec
from kvtool.layouts.lossy import bound_violation, chain_error_bound
from kvtool.layouts.outliers import Outliers
from kvtool.recipe import Recipe
from kvtool.testing.layouts import bits_of, random_bits, stored_and_read_back

from native_checks import needs_core

CHAINS = ["outliers:0.01|int:3,group=128", "outliers:0.02|int:4,group=64,kbits=5,layers=k1:8",
          "outliers:0.05,k=token,v=channel|int:2,k=token,v=channel,group=16", "outliers:0.01,v=none|int:3"]


@pytest.fixture(scope="module")
def small(samples) -> KVCache:
    """Four layers, 300 tokens (a partial last chunk) of a real sample."""
    return KVCache.load(samples[0], layers=[0, 1, 14, 29], tokens=slice(0, 300))


def plain_select(row: np.ndarray, count: int) -> tuple[list[int], list[int]]:
    """The docstring's rule, one row at a time in plain Python: outlier positions and the bits each gets."""
    bits = [int(b) for b in row.view(f"u{row.itemsize}")]
    top = 1 << (8 * row.itemsize - 1)
    order = sorted(range(len(bits)), key=lambda p: ((~bits[p]) & (2 * top - 1) if bits[p] & top else bits[p] | top, p))
    with np.errstate(invalid="ignore"):
        values = row.astype(np.float64)
    spans = []
    for i in range(count + 1):
        with np.errstate(invalid="ignore"):
            span = values[order[len(bits) - 1 - count + i]] - values[order[i]]
        spans.append(math.inf if math.isnan(span) else span)
    taken = spans.index(min(spans))
    low, high = order[:taken], order[len(bits) - count + taken :]
    fill = {p: bits[order[taken]] for p in low} | {p: bits[order[len(bits) - 1 - count + taken]] for p in high}
    positions = sorted(low + high)
    return positions, [fill[p] for p in positions]


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_selection_matches_a_plain_reference(dtype, axis):
    layout = Outliers(0.1, k=axis, v=axis)
    rng = np.random.default_rng(3)
    blocks = [random_bits(dtype, (2, 9, 12), seed=1),  # NaNs, infinities, -0 among them
              np.round(rng.normal(size=(2, 9, 12)) * 3).astype(DTYPES[dtype].numpy)]  # many ties
    for block in blocks:
        dense, pos, val = layout.forward([block])
        rows = (block.transpose(0, 2, 1) if axis == "channel" else block).reshape(-1, block.shape[1 if axis == "channel" else 2])
        dense_rows = (dense.transpose(0, 2, 1) if axis == "channel" else dense).reshape(rows.shape)
        _, length, count = layout.counts(axis, block.shape)
        assert count == min(math.ceil(0.1 * length), (length - 1) // 2)
        for r, row in enumerate(rows):
            positions, fill = plain_select(row, count)
            assert list(pos[r * count : (r + 1) * count]) == positions
            assert list(val[r * count : (r + 1) * count]) == [int(b) for b in row.view(f"u{row.itemsize}")[positions]]
            assert [int(b) for b in dense_rows[r].view(f"u{row.itemsize}")[positions]] == fill
            kept = np.setdiff1d(np.arange(length), positions)
            assert np.array_equal(bits_of(dense_rows[r])[kept], bits_of(row)[kept])


def test_counts_and_planes():
    layout = Outliers(0.01)
    assert layout.counts("channel", (3, 256, 64)) == (192, 256, 3)
    assert layout.counts("token", (3, 256, 64)) == (768, 64, 1)
    assert layout.counts("token", (3, 256, 2)) == (768, 2, 0)  # never all of a row, nor half
    assert Outliers(0.07).counts("channel", (1, 100, 1))[2] == 7  # 0.07 * 100 is 7.000000000000001 in floats
    specs = layout.plan([PlaneSpec("data", (3, 256, 64), DTYPES["bf16"].numpy)])
    assert [(s.name, s.shape, np.dtype(s.dtype)) for s in specs] == [
        ("data", (3, 256, 64), DTYPES["bf16"].numpy), ("outlier.pos", (768,), np.uint8), ("outlier.val", (768,), np.uint16)]
    assert layout.plan([PlaneSpec("data", (1, 257, 4), np.float32)])[1].dtype == np.uint16
    big = layout.plan([PlaneSpec("data", (1, 70000, 4), np.float32)])
    assert big[1].dtype == np.uint32 and big[2].dtype == np.uint32
    _, pos, val = Outliers(0.2, v="none").for_kind("v").forward([np.arange(32, dtype=np.float32).reshape(1, 8, 4)])
    assert pos.size == 8 and not pos.any() and not val.any()  # sized for the keys' rows, none used


@pytest.mark.parametrize("bad", ["outliers:0.6", "outliers:-0.1", "outliers:x", "outliers:0.1,k=head", "outliers:0.1,group=4"])
def test_bad_specs(bad):
    with pytest.raises(UsageError):
        get_layout(bad)


def test_recipe_rules():
    assert Recipe.parse("outliers:0.01|int:3,group=128|zstd:3").lossy
    assert not Recipe.parse("outliers:0.01|zstd:3").lossy
    for bad in ["outliers:0.01|outliers:0.02|int:3|zstd:3", "outliers:0.01|byteplane|int:3|zstd:3", "byteplane|int:3|zstd:3"]:
        with pytest.raises(UsageError, match="lossy stage"):
            Recipe.parse(bad)
    with pytest.raises(UsageError, match="takes one"):
        Recipe.parse("outliers:0.01|exphuff").plan(PlaneSpec("data", (3, 8, 64), DTYPES["bf16"].numpy))


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("spec", CHAINS)
def test_outliers_come_back_exact_and_the_rest_within_int_bound(real_arrays, spec, kind, layer):
    chain = parse_layouts(spec)
    bound = chain.for_kind(kind, layer)
    int_alone = parse_layouts(spec.partition("|")[2]).for_kind(kind, layer)
    worse = 0
    for array in real_arrays:
        inputs = [PlaneSpec.of(array)]
        specs = bound.plan(inputs)
        assert all(specs == chain.for_kind(k, n).plan(inputs) for k in "kv" for n in (0, 1)), "planes must not depend on the tensor"
        (restored,) = bound.inverse(stored_and_read_back(bound.forward([array]), specs), inputs)
        out = np.empty_like(array)
        bound.inverse_into(stored_and_read_back(bound.forward([array]), specs), PlaneSpec.of(array), out)
        assert np.array_equal(bits_of(out), bits_of(restored))
        error = np.abs(restored.astype(np.float64) - array.astype(np.float64))
        limit = chain_error_bound(bound, array)
        assert (error <= limit).all()
        _, exact = bound[0].split(array)
        assert np.array_equal(bits_of(restored)[exact], bits_of(array)[exact])
        (plain,) = int_alone.inverse(int_alone.forward([array]), inputs)
        worse += np.square(error).sum() > np.square(plain.astype(np.float64) - array.astype(np.float64)).sum()
    assert worse == 0, "keeping outliers apart never made a real tensor's error larger"


@pytest.mark.parametrize("recipe", ["outliers:0.01|int:3,group=128|zstd:3", "outliers:0.02|zstd:1"])
def test_through_the_container(small, recipe):
    parsed = Recipe.parse(recipe)
    blob = encode_cache(small, parsed, chunk_tokens=128)
    with KvzReader.from_bytes(blob) as reader:
        reader.verify(full=True)
        restored = reader.read()
        assert (reader.lossy is not None) == parsed.lossy
    if parsed.lossy:
        assert bound_violation(small.tensors(), [a for _, _, a in restored.tensors()], parsed.layouts, 128) is None
    else:
        assert restored.equal_bits(small)


def _bad_planes(layout: Outliers, block: np.ndarray, damage: str) -> list[np.ndarray]:
    dense, pos, val = (p.copy() for p in layout.forward([block]))
    if damage == "beyond":
        pos[0] = block.shape[1]
    elif damage == "repeated":
        pos[1] = pos[0]
    else:  # something in the unused tail
        pos[-1] = 1
    return [dense, pos, val]


@pytest.mark.parametrize("damage", ["beyond", "repeated", "tail"])
def test_bad_outlier_positions_are_a_clear_error(damage):
    layout = Outliers(0.1, k="channel", v="token").for_kind("k")
    block = np.random.default_rng(0).normal(size=(2, 20, 4)).astype(np.float32)  # keys: 2 per row; values would need more
    planes = _bad_planes(layout, block, damage)
    with pytest.raises(DecodeError, match="outlier"):
        layout.inverse(planes, [PlaneSpec.of(block)])


def test_a_file_with_bad_positions_and_good_checksums_is_refused(small, monkeypatch):
    """A crafted .kvz: the writer's planes damaged before the checksums are made."""
    honest = Outliers.forward_plane

    def crafted(self, plane):
        dense, pos, val = honest(self, plane)
        pos = pos.copy()
        pos[0] = plane.shape[1] + 5
        return [dense, pos, val]

    monkeypatch.setattr(Outliers, "forward_plane", crafted)
    blob = encode_cache(small, "outliers:0.02|zstd:1", chunk_tokens=128)
    monkeypatch.setattr(Outliers, "forward_plane", honest)
    with pytest.raises(DecodeError, match="outlier positions"):
        decode_cache(blob)


# -- the C core against the numpy reference ------------------------------------------------------



def _same_bytes(ours: list[np.ndarray], theirs: list[np.ndarray]) -> bool:
    return all(a.dtype == b.dtype and bits_of(a).tobytes() == bits_of(b).tobytes() for a, b in zip(ours, theirs))


@needs_core
@pytest.mark.parametrize("spec", ["outliers:0.01", "outliers:0.1", "outliers:0.5", "outliers:0.02,k=token,v=channel"])
def test_the_core_writes_the_reference_bytes_on_real_samples(spec, samples):
    layout = get_layout(spec)
    for path in samples:
        for layer, kind, array in KVCache.load(path).tensors():
            bound = layout.for_kind(kind, layer)
            for block in (array, array[:, :37]):
                native = bound.forward([block])
                assert _same_bytes(native, bound.reference_forward(block))
                out, ref = np.empty_like(block), np.empty_like(block)
                bound.inverse_plane_into(native, PlaneSpec.of(block), out)
                bound.reference_inverse_into(native, PlaneSpec.of(block), ref)
                assert np.array_equal(bits_of(out), bits_of(block)) and np.array_equal(bits_of(ref), bits_of(block))


@needs_core
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(2, 9, 12), (1, 300, 3), (3, 1, 5), (2, 4, 257)])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_core_writes_the_reference_bytes_on_any_bits(dtype, shape, seed):
    """Random bit patterns (NaN, infinities, -0, subnormals) and rows with many ties."""
    rng = np.random.default_rng(seed)
    blocks = [random_bits(dtype, shape, seed=seed), rng.integers(-2, 3, size=shape).astype(DTYPES[dtype].numpy)]
    for axis in ("channel", "token"):
        layout = Outliers(0.2, k=axis, v=axis)
        for block in blocks:
            native = layout.forward([block])
            assert _same_bytes(native, layout.reference_forward(block))
            (restored,) = layout.inverse(native, [PlaneSpec.of(block)])
            assert np.array_equal(bits_of(restored), bits_of(block))


@needs_core
@pytest.mark.parametrize("damage", ["beyond", "repeated", "tail"])
def test_the_core_declines_bad_positions_and_the_reference_says_why(damage, monkeypatch):
    layout = Outliers(0.1, k="channel", v="token").for_kind("k")
    block = np.random.default_rng(0).normal(size=(2, 20, 4)).astype(np.float32)
    planes = _bad_planes(layout, block, damage)
    core = _native.core()
    assert core.outliers_merge(*[_native.byte_view(np.ascontiguousarray(p)) for p in planes], _native.byte_view(np.empty_like(block)),
                               _native.DTYPE_CODES["fp32"], 2, 20, 4, True, 2) == 1
    with pytest.raises(DecodeError, match="outlier"):
        layout.inverse(planes, [PlaneSpec.of(block)])
