"""Every registered layout, and chains of them, through the shared conformance suite."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import sample_paths
from kvtool.cache import DTYPES, KVCache
from kvtool.errors import DecodeError, UnknownIdError, UsageError
from kvtool.layouts import LayoutChain, get_layout, layout_from_config, parse_layouts, registry
from kvtool.layouts.base import PlaneSpec
from kvtool.layouts.xor_delta import XorDelta
from kvtool.testing import LayoutTests
from kvtool.testing.layouts import assert_round_trip, in_a_dtype_it_takes, random_bits

LAYOUTS = ["token-major", "channel-major", "byteplane", "bf16-split", "fp16-split", "xor-delta", "xor-delta:-1", "sx-split", "sx-split:-1",
           "outliers:0.05,v=channel", "outliers:0.3,k=token"]
CHAINS = [
    "",
    "channel-major|byteplane",
    "channel-major|bf16-split",
    "xor-delta|byteplane",
    "channel-major|xor-delta|bf16-split",
    "bf16-split|xor-delta|channel-major",
    "fp16-split|byteplane",
    "byteplane|channel-major|xor-delta",
    "channel-major|sx-split",
    "outliers:0.02,v=channel|byteplane",
]
#: The dtypes each layout takes; it refuses the others with UsageError.
ACCEPTS = {"bf16-split": {"bf16"}, "fp16-split": {"fp16"}, "sx-split": {"bf16", "fp16", "fp8_e4m3", "fp8_e5m2"},
           "outliers": {"bf16", "fp16", "fp32"}}


#: The lossless layouts; the lossy stages have their own suite (tests/test_lossy.py).
LOSSLESS = sorted(i for i in registry.ids() if not registry.get(i).lossy)


def test_every_registered_layout_is_covered():
    assert {spec.partition(":")[0] for spec in LAYOUTS} == set(LOSSLESS)


@pytest.fixture(scope="module")
def real_arrays() -> list[np.ndarray]:
    """Every K and V tensor of the real samples, or KV-like data where there are none."""
    arrays = [a for path in sample_paths() for _, _, a in KVCache.load(path).tensors()]
    if not arrays:
        from kvtool.testing.data import kv_like_bf16

        arrays = [kv_like_bf16(tokens=256, seed=s) for s in range(4)]
    return arrays


class TestRegisteredLayouts(LayoutTests):
    @pytest.fixture(params=LAYOUTS)
    def layout(self, request):
        return get_layout(request.param)

    @pytest.fixture
    def kv_arrays(self, real_arrays):
        return real_arrays


class TestChains(LayoutTests):
    @pytest.fixture(params=CHAINS)
    def layout(self, request):
        return parse_layouts(request.param)

    @pytest.fixture
    def kv_arrays(self, real_arrays):
        return real_arrays


@pytest.mark.parametrize("layout_id", LOSSLESS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_which_dtypes_each_layout_takes(layout_id, dtype):
    layout = get_layout(layout_id).for_kind("k")  # bound as a container binds it (outliers rows keys and values apart)
    array = random_bits(dtype, (2, 5, 8))
    if dtype in ACCEPTS.get(layout_id, set(DTYPES)):
        assert_round_trip(layout, array)
    else:
        with pytest.raises(UsageError, match=dtype):
            layout.plan([PlaneSpec.of(array)])
        with pytest.raises(UsageError, match=dtype):
            layout.forward([array])


def test_plane_names_and_shapes():
    spec = [PlaneSpec("data", (3, 5, 64), DTYPES["bf16"].numpy)]
    n = 3 * 5 * 64
    plan = parse_layouts("channel-major|bf16-split").plan(spec)
    assert [(p.name, p.shape, p.dtype) for p in plan] == [
        ("exp", (3, 64, 5), np.uint8),
        ("sign", (n // 8,), np.uint8),
        ("mant", (n * 7 // 8,), np.uint8),
    ]
    assert [p.name for p in parse_layouts("fp16-split|byteplane").plan([PlaneSpec("data", (1, 2, 3), np.float16)])] == [
        "exp", "sign", "mant.hi", "mant.lo",
    ]
    assert [p.name for p in parse_layouts("byteplane").plan([PlaneSpec("data", (1, 2), np.float32)])] == ["b3", "b2", "b1", "b0"]


def test_byteplane_is_most_significant_first():
    hi, lo = get_layout("byteplane").forward([np.array([[0x1234]], np.uint16)])
    assert (hi[0, 0], lo[0, 0]) == (0x12, 0x34)


def test_bf16_split_fields():
    values = np.array([[-1.5, 2.0, 0.0, -0.0, 1e-40]], DTYPES["fp32"].numpy).astype(DTYPES["bf16"].numpy)
    exp, sign, mant = get_layout("bf16-split").forward([values])
    assert exp[0].tolist() == [127, 128, 0, 0, 0]
    assert np.unpackbits(sign)[:5].tolist() == [1, 0, 0, 1, 0]
    assert mant.tolist() == [0x40, 0, 0, 0, values.view(np.uint16)[0, 4] & 0x7F]


def test_bf16_split_mantissa_packing_matches_its_description():
    bits = np.random.default_rng(3).integers(0, 1 << 16, size=(1, 19, 1), dtype=np.uint16)
    exp, sign, mant = get_layout("bf16-split").forward([bits.view(DTYPES["bf16"].numpy)])
    m, q = (bits.reshape(-1) & 0x7F).astype(np.uint8), 19 // 8
    expected = [m[j * q + i] | ((m[7 * q + i] >> j) & 1) << 7 for j in range(7) for i in range(q)] + list(m[8 * q :])
    assert mant.tolist() == expected
    assert exp.reshape(-1).tolist() == ((bits.reshape(-1) >> 7) & 0xFF).tolist()
    assert np.unpackbits(sign)[:19].tolist() == (bits.reshape(-1) >> 15).tolist()


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
@pytest.mark.parametrize("shape", [(2, 16, 8), (3, 7, 5), (1, 40, 1)])
@pytest.mark.parametrize("axis", [-1, -2, -3])
def test_xor_delta_matches_a_plain_reference(dtype, shape, axis):
    values = np.random.default_rng(0).integers(0, np.iinfo(dtype).max, size=shape, dtype=dtype)
    moved = np.moveaxis(values, axis, 0)
    reference = np.concatenate([moved[:1], moved[1:] ^ moved[:-1]])
    layout = XorDelta(axis)
    (deltas,) = layout.forward([values])
    assert np.array_equal(np.moveaxis(deltas, axis, 0), reference)
    assert_round_trip(layout, values)


def test_xor_delta_values():
    planes = np.array([[[1, 2], [3, 2], [3, 6]]], np.uint16)
    (tokens,) = get_layout("xor-delta").forward([planes])
    assert tokens[0].tolist() == [[1, 2], [2, 0], [0, 4]]
    (dims,) = get_layout("xor-delta:-1").forward([planes])
    assert dims[0].tolist() == [[1, 3], [3, 1], [3, 5]]


def test_xor_delta_follows_the_token_axis():
    assert parse_layouts("xor-delta")[0].axis == -2
    assert parse_layouts("channel-major|xor-delta")[1].axis == -1
    assert parse_layouts("channel-major|xor-delta:-2")[1].axis == -2
    assert parse_layouts("channel-major|xor-delta").spec() == "channel-major|xor-delta:-1"
    assert parse_layouts("channel-major|xor-delta").get_config() == [{"id": "channel-major"}, {"id": "xor-delta", "axis": -1}]


def test_chain_outputs_are_contiguous(real_arrays):
    for spec in CHAINS:
        chain = parse_layouts(spec)
        for plane in chain.forward([in_a_dtype_it_takes(chain, real_arrays[0])[:, 1:30]]):
            assert plane.flags.c_contiguous


@pytest.mark.parametrize("spec", ["", "token-major", " token-major "])
def test_identity_specs(spec, real_arrays):
    chain = parse_layouts(spec)
    array = real_arrays[0]
    assert chain.plan([PlaneSpec.of(array)]) == [PlaneSpec.of(array)]
    assert_round_trip(chain, array)


@pytest.mark.parametrize(
    "spec, error, words",
    [
        ("byteplane|nope", UnknownIdError, ["stage 2", "'nope'", "known:", "byteplane", "xor-delta"]),
        ("byteplane||channel-major", UsageError, ["stage 2", "empty"]),
        ("xor-delta:x", UsageError, ["stage 1", "negative integer"]),
        ("xor-delta:2", UsageError, ["stage 1", "negative integer"]),
        ("channel-major:3", UsageError, ["stage 1", "takes no ':' argument"]),
    ],
)
def test_parse_errors_name_the_stage(spec, error, words):
    with pytest.raises(error) as info:
        parse_layouts(spec)
    for word in words:
        assert word in str(info.value)


def test_bad_configs():
    with pytest.raises(UsageError):
        layout_from_config({"axis": -2})
    with pytest.raises(UsageError, match="no parameter"):
        layout_from_config({"id": "byteplane", "level": 3})
    with pytest.raises(UnknownIdError):
        layout_from_config({"id": "nope"})


def test_chain_inverse_checks_plane_sizes(real_arrays):
    chain = parse_layouts("")
    array = real_arrays[0]
    with pytest.raises(DecodeError):
        chain.inverse([array[:, 1:]], [PlaneSpec.of(array)])


def test_inverse_of_wrong_input_spec_is_refused():
    with pytest.raises(UsageError):
        get_layout("bf16-split").inverse([], [PlaneSpec("data", (1, 2, 3), np.float16)])
    assert LayoutChain() == parse_layouts("") and XorDelta(-1) == get_layout("xor-delta:-1")
