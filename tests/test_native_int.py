"""The C forward and inverse of the lossy ``int`` stage against their numpy reference: the same bytes and bits,
on real samples, generated blocks and crafted planes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.cache import KVCache
from kvtool.errors import UsageError
from kvtool.layouts.base import PlaneSpec
from kvtool.layouts.int_quant import IntQuant

from native_checks import needs_core



def both(layout: IntQuant, planes: list[np.ndarray], spec: PlaneSpec) -> tuple[np.ndarray, np.ndarray]:
    native = np.empty(spec.shape, spec.dtype)
    assert layout._native_inverse(planes, spec, native), "the core declined planes it should restore"
    return native, layout.reference_inverse(planes, spec)


def assert_same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def real_blocks(path, bits: int, axis: str):
    """``(layout, block)`` over two real tensors in three dtypes, four group sizes and four token counts."""
    cache = KVCache.load(path)
    for array in (cache.keys[3], cache.values[20]):
        for dtype in (array.dtype, np.float16, np.float32):
            for group in (1, 7, 64, 300):
                for tokens in (0, 1, 37, array.shape[1]):
                    yield IntQuant(bits, k=axis, v=axis, group=group), np.ascontiguousarray(array[:, :tokens].astype(dtype))


@needs_core
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_real_samples_restore_alike(samples, bits, axis):
    for layout, block in real_blocks(samples[0], bits, axis):
        assert_same_bits(*both(layout, layout.forward_plane(block), PlaneSpec.of(block)))


@needs_core
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_real_samples_quantize_alike(samples, bits, axis):
    for layout, block in real_blocks(samples[0], bits, axis):
        native = layout._native_forward(block)
        assert native is not None
        for ours, theirs in zip(native, layout.reference_forward(block)):
            assert_same_bits(ours, theirs)


@st.composite
def float_blocks(draw):
    dtype = draw(st.sampled_from([ml_dtypes.bfloat16, np.float16, np.float32]))
    shape = (draw(st.integers(0, 3)), draw(st.integers(0, 40)), draw(st.integers(1, 24)))
    kind = draw(st.sampled_from(["kv", "wide", "few", "bits"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "bits":  # any bit pattern: NaN, infinity and values beyond fp16 among them
        width = np.dtype(dtype).itemsize
        return rng.integers(0, 1 << (8 * width), size=shape, dtype=np.uint64).astype(f"u{width}").view(dtype)
    if kind == "few":  # signed zeros and repeats: constant groups, a zero least value
        return rng.choice(np.array([0.0, -0.0, 1.5, -2.0]), size=shape).astype(dtype)
    exponents = rng.uniform(-30, 16, size=(shape[0], 1, shape[2])) if kind == "wide" else rng.normal(0, 2, (shape[0], 1, shape[2]))
    return (rng.standard_normal(shape) * np.exp2(exponents)).clip(-65504, 65504).astype(dtype)


@needs_core
@settings(max_examples=300, deadline=None)
@given(block=float_blocks(), bits=st.integers(1, 8), axis=st.sampled_from(["channel", "token"]), group=st.integers(1, 70))
def test_generated_blocks_quantize_alike(block, bits, axis, group):
    """The same planes, or a refusal from both (then the reference's error is the one raised)."""
    layout = IntQuant(bits, k=axis, v=axis, group=group)
    native = layout._native_forward(block)
    try:
        reference = layout.reference_forward(block)
    except UsageError:
        assert native is None
        with pytest.raises(UsageError):
            layout.forward_plane(block)
        return
    assert native is not None
    for ours, theirs in zip(native, reference):
        assert_same_bits(ours, theirs)


@needs_core
@settings(max_examples=200, deadline=None)
@given(
    bits=st.integers(1, 8), axis=st.sampled_from(["channel", "token"]), group=st.integers(1, 70),
    shape=st.tuples(st.integers(0, 3), st.integers(0, 50), st.integers(1, 40)),
    dtype=st.sampled_from([ml_dtypes.bfloat16, np.float16, np.float32]), seed=st.integers(0, 2**32 - 1),
)
def test_crafted_planes_restore_alike(bits, axis, group, shape, dtype, seed):
    """Any codes and any finite fp16 (scale, min) pairs, subnormal and huge ones included: values that
    round to infinity or to subnormals in the output dtype come back the same from both."""
    rng = np.random.default_rng(seed)
    layout = IntQuant(bits, k=axis, v=axis, group=group)
    spec = PlaneSpec("data", shape, np.dtype(dtype))
    codes_spec, scales_spec = layout.plan_plane(spec)
    codes = rng.integers(0, 256, codes_spec.shape, dtype=np.uint8)
    pairs = rng.integers(0, 1 << 16, scales_spec.shape, dtype=np.uint16)
    pairs[(pairs & 0x7C00) == 0x7C00] &= 0xBFFF  # no infinities or NaNs: the core leaves those to the reference
    assert_same_bits(*both(layout, [codes, pairs.view(np.float16)], spec))


@needs_core
def test_non_finite_scales_are_left_to_the_reference(samples):
    block = np.ascontiguousarray(KVCache.load(samples[0]).keys[0][:, :16])
    layout = IntQuant(4, k="token", v="token", group=64)
    codes, scales = layout.forward_plane(block)
    scales = scales.copy()
    scales[0, 0, 0] = np.inf
    assert not layout._native_inverse([codes, scales], PlaneSpec.of(block), np.empty_like(block))
    with np.errstate(invalid="ignore"):
        assert_same_bits(layout.inverse_plane([codes, scales], PlaneSpec.of(block)),
                         layout.reference_inverse([codes, scales], PlaneSpec.of(block)))


def test_values_that_would_come_back_infinite_are_refused():
    """fp16 values near its limit: the rounded-up scale would carry the largest code past 65504."""
    block = np.tile(np.array([-65504, 65504], np.float16), 2 * 16 * 4).reshape(2, 16, 8)
    with pytest.raises(UsageError, match="infinity|fp16 scale"):
        IntQuant(4, k="token", v="token", group=8).forward_plane(block)
    codes, _ = IntQuant(4, k="token", v="token", group=8).forward_plane((block / 4).astype(np.float16))
    assert codes.size == block.size // 2
