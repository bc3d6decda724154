"""``LossyLayoutTests``: the conformance suite for a lossy stage (``Layout.lossy``).

``LayoutTests`` demands bit-exact round trips, which a lossy stage cannot
give; this suite demands what a container relies on from one instead. Per
tensor kind and layer (the stage is bound with ``for_kind``, as a container
binds it): ``plan`` predicts every output plane exactly and does not depend on
the tensor;
planes read back from their bytes invert to the input's shape and dtype with
every value within the stage's own ``error_bound``; the same input gives the
same bytes; every lossy input dtype (bf16, fp16, fp32) is taken and the others
refused with ``UsageError``, as are NaN and infinity; 0, 1 and odd token
counts and non-contiguous input work; the config rebuilds the stage through
the registry; ``inverse`` given planes of the wrong count, shape or dtype
raises ``DecodeError``.

Subclasses provide a ``layout`` fixture and may override ``kv_arrays`` with
real K/V blocks ``[heads, tokens, dim]``.
"""

from __future__ import annotations

import json
from typing import cast

import numpy as np
import pytest

from kvtool.cache import DTYPES
from kvtool.errors import DecodeError, UsageError
from kvtool.layouts import Layout, LayoutChain, get_layout, layout_from_config
from kvtool.layouts.base import PlaneSpec
from kvtool.layouts.lossy import LOSSY_INPUTS, LossyLayout
from kvtool.testing.data import kv_like_bf16
from kvtool.testing.layouts import TOKEN_COUNTS, bits_of, stored_and_read_back

KINDS = ("k", "v")
#: The layers a stage is bound to: a stage may give layers widths of their own (``int``'s ``layers=``).
LAYERS = (0, 1)


def assert_within_bound(layout: Layout, array: np.ndarray, kind: str, layer: int = 0) -> np.ndarray:
    """Round-trip ``array`` through ``layout`` bound to ``kind`` and ``layer`` and its planes' bytes; return the
    approximation."""
    bound = cast(LossyLayout, layout.for_kind(kind, layer))
    before = bits_of(array).copy()
    inputs = [PlaneSpec.of(array)]
    specs = bound.plan(inputs)
    for other in [(k, n) for k in KINDS for n in LAYERS]:
        assert specs == layout.for_kind(*other).plan(inputs), "planes must not depend on the tensor"
    planes = bound.forward([array])
    assert [(p.shape, p.dtype) for p in planes] == [(s.shape, np.dtype(s.dtype)) for s in specs]
    assert np.array_equal(bits_of(array), before), "forward changed its input"
    assert [bits_of(p).tobytes() for p in bound.forward([array])] == [bits_of(p).tobytes() for p in planes]
    (restored,) = bound.inverse(stored_and_read_back(planes, specs), inputs)
    assert restored.shape == array.shape and restored.dtype == array.dtype
    error = np.abs(restored.astype(np.float64) - array.astype(np.float64))
    limit = bound.error_bound(array)
    assert limit.shape == array.shape
    worst = np.unravel_index(np.argmax(error - limit), array.shape) if array.size else None
    assert (error <= limit).all(), f"error {error[worst]} over the bound {limit[worst]} at {worst} ({kind})"
    return restored


class LossyLayoutTests:
    """Base class; subclasses define a ``layout`` fixture returning a lossy ``Layout``."""

    @pytest.fixture
    def layout(self) -> Layout:  # pragma: no cover - replaced by subclasses
        raise NotImplementedError("subclasses of LossyLayoutTests provide a `layout` fixture")

    @pytest.fixture
    def kv_arrays(self) -> list[np.ndarray]:
        """K/V blocks ``[heads, tokens, dim]``; subclasses may return real samples."""
        return [kv_like_bf16(seed=0), kv_like_bf16(heads=2, tokens=64, dim=32, seed=1)]

    def test_is_marked_lossy(self, layout):
        assert layout.lossy and LayoutChain([layout]).lossy

    @pytest.mark.parametrize("layer", LAYERS)
    @pytest.mark.parametrize("kind", KINDS)
    def test_real_kv_data_within_bound(self, layout, kv_arrays, kind, layer):
        for array in kv_arrays:
            assert_within_bound(layout, array, kind, layer)

    @pytest.mark.parametrize("dtype", sorted(DTYPES))
    def test_every_dtype(self, layout, kv_arrays, dtype):
        """The lossy input dtypes are taken (real values cast), the others refused with UsageError."""
        array = kv_arrays[0].astype(np.float32).astype(DTYPES[dtype].numpy)
        if dtype not in LOSSY_INPUTS:
            with pytest.raises(UsageError, match=dtype):
                layout.plan([PlaneSpec.of(array)])
            with pytest.raises(UsageError, match=f"takes .*{dtype}"):
                layout.for_kind("k", 0).forward([array])
            return
        for kind in KINDS:
            assert_within_bound(layout, array, kind)

    @pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
    def test_non_finite_values_refused(self, layout, kv_arrays, value):
        array = kv_arrays[0].copy()
        array[0, min(1, array.shape[1] - 1), 0] = value
        with pytest.raises(UsageError, match="finite"):
            layout.for_kind("k", 0).forward([array])

    @pytest.mark.parametrize("tokens", TOKEN_COUNTS)
    def test_token_counts(self, layout, kv_arrays, tokens):
        source = max(kv_arrays, key=lambda a: a.shape[1])
        array = np.concatenate([source] * (tokens // source.shape[1] + 1), axis=1)[:, :tokens]
        for kind in KINDS:
            assert_within_bound(layout, array, kind)

    @pytest.mark.parametrize("view", ["token-slice", "token-stride", "reversed-dim", "fortran"])
    def test_non_contiguous_input(self, layout, kv_arrays, view):
        array = {
            "token-slice": lambda a: a[:, 3:40],
            "token-stride": lambda a: a[:, ::3],
            "reversed-dim": lambda a: a[..., ::-1],
            "fortran": np.asfortranarray,
        }[view](kv_arrays[0])
        for kind in KINDS:
            assert_within_bound(layout, array, kind)

    def test_config_round_trip(self, layout):
        config = layout.get_config()
        assert json.loads(json.dumps(config)) == config
        assert config["id"] == layout.layout_id
        assert layout_from_config(config) == layout
        assert get_layout(layout.spec()) == layout
        assert layout.for_kind("k", 1) == layout  # binding to a tensor is not part of the config

    def test_inverse_rejects_wrong_planes(self, layout, kv_arrays):
        bound = layout.for_kind("v", 0)
        array = kv_arrays[0]
        inputs = [PlaneSpec.of(array)]
        specs = bound.plan(inputs)
        planes = stored_and_read_back(bound.forward([array]), specs)
        with pytest.raises(DecodeError):
            bound.inverse(planes + planes[-1:], inputs)
        for i in range(len(planes)):
            with pytest.raises(DecodeError):
                bound.inverse(planes[:i] + [planes[i].reshape(-1)[:-1]] + planes[i + 1 :], inputs)
            if planes[i].itemsize > 1:
                with pytest.raises(DecodeError):
                    bound.inverse(planes[:i] + [planes[i].view(np.uint8)] + planes[i + 1 :], inputs)
