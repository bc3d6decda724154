"""``LayoutTests``: the conformance suite for a layout or a chain of layouts.

Subclasses provide a ``layout`` fixture (a ``Layout`` or a ``LayoutChain``) and
may override ``kv_arrays`` with real K/V blocks ``[heads, tokens, dim]``. The
suite checks what a container relies on: ``plan`` predicts every output plane
exactly, each plane's bytes read back with ``np.frombuffer(...).reshape(shape)``
invert bit for bit, for every dtype (or a clear ``UsageError`` for a dtype the
layout does not take), for 0, 1 and odd token counts and non-contiguous input;
the config rebuilds the same layout through the registry; and ``inverse`` given
planes of the wrong count, shape or dtype raises ``DecodeError``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtool.dtypes import DTYPES
from kvtool.errors import DecodeError, UsageError
from kvtool.layouts import Layout, LayoutChain, get_layout, layout_from_config, parse_layouts
from kvtool.layouts.base import PlaneSpec
from kvtool.testing.data import kv_like_bf16

TOKEN_COUNTS = [0, 1, 2, 3, 7, 8, 9, 63, 255, 257]


def random_bits(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Uniformly random bit patterns of a kvtool dtype: NaNs, infinities, -0 and subnormals included."""
    d = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1 << (8 * d.itemsize), size=shape, dtype=d.bits_view).view(d.numpy)


def bits_of(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(f"u{array.itemsize}")


def stored_and_read_back(planes: list[np.ndarray], specs: list[PlaneSpec]) -> list[np.ndarray]:
    """Each plane through bytes, as a container writes and reads it (read-only arrays)."""
    out = []
    for plane, spec in zip(planes, specs):
        raw = np.ascontiguousarray(plane).reshape(-1).view(np.uint8).tobytes()
        assert len(raw) == spec.nbytes, f"plane {spec.name!r}: {len(raw)} bytes, plan says {spec.nbytes}"
        out.append(np.frombuffer(raw, dtype=spec.dtype).reshape(spec.shape))
    return out


def in_a_dtype_it_takes(layout: Layout | LayoutChain, array: np.ndarray) -> np.ndarray:
    """``array``, or its values cast to the first kvtool dtype the layout takes (fp16 for ``fp16-split``)."""
    for dtype in [array.dtype] + [d.numpy for d in DTYPES.values()]:
        candidate = array if dtype == array.dtype else array.astype(np.float32).astype(dtype)
        try:
            layout.plan([PlaneSpec.of(candidate)])
        except UsageError:
            continue
        return candidate
    pytest.fail(f"{layout!r} takes none of the dtypes {', '.join(DTYPES)}")


def assert_round_trip(layout: Layout | LayoutChain, array: np.ndarray) -> None:
    """``forward`` matches ``plan``, ``inverse`` and ``inverse_into`` restore ``array`` bit for bit, leaving its inputs alone."""
    before = bits_of(array).copy()
    inputs = [PlaneSpec.of(array)]
    specs = layout.plan(inputs)
    planes = layout.forward([array])
    assert [(p.shape, p.dtype) for p in planes] == [(s.shape, np.dtype(s.dtype)) for s in specs]
    assert [p.nbytes for p in planes] == [s.nbytes for s in specs]
    assert len({s.name for s in specs}) == len(specs), f"plane names repeat: {[s.name for s in specs]}"
    assert np.array_equal(bits_of(array), before), "forward changed its input"
    for candidate in (planes, stored_and_read_back(planes, specs)):
        (restored,) = layout.inverse(candidate, inputs)
        assert restored.shape == array.shape and restored.dtype == array.dtype
        assert np.array_equal(bits_of(restored), before)
        into = np.empty(array.shape, array.dtype)  # as a reader decodes a block into its destination
        layout.inverse_into(candidate, inputs[0], into)
        assert np.array_equal(bits_of(into), before), "inverse_into differs from inverse"


class LayoutTests:
    """Base class; subclasses define a ``layout`` fixture returning a ``Layout`` or ``LayoutChain``."""

    @pytest.fixture
    def layout(self) -> Layout | LayoutChain:  # pragma: no cover - replaced by subclasses
        raise NotImplementedError("subclasses of LayoutTests provide a `layout` fixture")

    @pytest.fixture
    def kv_arrays(self) -> list[np.ndarray]:
        """K/V blocks ``[heads, tokens, dim]`` to round-trip; subclasses may return real samples."""
        return [kv_like_bf16(seed=0), kv_like_bf16(heads=2, tokens=64, dim=32, seed=1)]

    def test_real_kv_data(self, layout, kv_arrays):
        for array in kv_arrays:
            assert_round_trip(layout, in_a_dtype_it_takes(layout, array))

    @pytest.mark.parametrize("dtype", sorted(DTYPES))
    def test_every_dtype(self, layout, kv_arrays, dtype):
        """Each dtype round-trips (random bit patterns and cast real data), or is refused with UsageError."""
        real = kv_arrays[0].astype(np.float32).astype(DTYPES[dtype].numpy)
        arrays = [random_bits(dtype, (3, 33, 64)), real]
        try:
            layout.plan([PlaneSpec.of(arrays[0])])
        except UsageError:
            with pytest.raises(UsageError):
                layout.forward([arrays[0]])
            return
        for array in arrays:
            assert_round_trip(layout, array)

    @pytest.mark.parametrize("tokens", TOKEN_COUNTS)
    def test_token_counts(self, layout, kv_arrays, tokens):
        source = in_a_dtype_it_takes(layout, max(kv_arrays, key=lambda a: a.shape[1]))
        array = np.concatenate([source] * (tokens // source.shape[1] + 1), axis=1)[:, :tokens]
        assert_round_trip(layout, array)
        assert_round_trip(layout, np.ascontiguousarray(array))

    @pytest.mark.parametrize("view", ["token-slice", "token-stride", "reversed-dim", "fortran", "heads-swapped"])
    def test_non_contiguous_input(self, layout, kv_arrays, view):
        array = in_a_dtype_it_takes(layout, kv_arrays[0])
        array = {
            "token-slice": lambda a: a[:, 3:40],
            "token-stride": lambda a: a[:, ::3],
            "reversed-dim": lambda a: a[..., ::-1],
            "fortran": np.asfortranarray,
            "heads-swapped": lambda a: np.ascontiguousarray(a.swapaxes(0, 1)).swapaxes(0, 1),
        }[view](array)
        assert_round_trip(layout, array)

    def test_config_round_trip(self, layout):
        config = layout.get_config()
        assert json.loads(json.dumps(config)) == config
        if isinstance(layout, LayoutChain):
            assert LayoutChain([layout_from_config(c) for c in config]) == layout
            assert parse_layouts(layout.spec()) == layout
        else:
            assert config["id"] == layout.layout_id
            assert layout_from_config(config) == layout
            assert get_layout(layout.spec()) == layout
            assert hash(layout_from_config(config)) == hash(layout)

    def test_inverse_rejects_wrong_planes(self, layout, kv_arrays):
        array = in_a_dtype_it_takes(layout, kv_arrays[0])
        inputs = [PlaneSpec.of(array)]
        specs = layout.plan(inputs)
        planes = stored_and_read_back(layout.forward([array]), specs)
        with pytest.raises(DecodeError):
            layout.inverse(planes[:-1], inputs)
        with pytest.raises(DecodeError):
            layout.inverse(planes + planes[-1:], inputs)
        for i, spec in enumerate(specs):
            short = planes[i].reshape(-1)[:-1]
            with pytest.raises(DecodeError):
                layout.inverse(planes[:i] + [short] + planes[i + 1 :], inputs)
            if planes[i].itemsize > 1:
                wrong_dtype = planes[i].view(np.uint8)
                with pytest.raises(DecodeError):
                    layout.inverse(planes[:i] + [wrong_dtype] + planes[i + 1 :], inputs)
