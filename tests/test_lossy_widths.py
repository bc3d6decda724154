"""The ``int`` stage's code widths per kind (``kbits=``, ``vbits=``) and per layer (``layers=``): each tensor
gets the width the recipe names, in the C core and the numpy reference alike, and the recipe in a file's
header is all a reader needs."""

from __future__ import annotations

import numpy as np
import pytest

from kvtool import _native
from kvtool.cache import KVCache
from kvtool.errors import UsageError
from kvtool.kvz import KvzReader, encode_cache
from kvtool.layouts import get_layout
from kvtool.layouts.base import PlaneSpec
from kvtool.layouts.int_quant import IntQuant


@pytest.fixture(scope="module")
def cache(samples) -> KVCache:
    return KVCache.load(samples[0], layers=[0, 1, 14], tokens=slice(0, 200))


def restored(cache: KVCache, recipe: str) -> dict[tuple[int, str], np.ndarray]:
    with KvzReader.from_bytes(encode_cache(cache, recipe, chunk_tokens=64)) as reader:
        return {(layer, kind): array for layer, kind, array in reader.read().tensors()}


def test_each_tensor_gets_its_own_width(cache):
    """Keys in 8 bits, values in 2, layer 1's values in 8: each tensor restores as the one-width recipe of its
    width restores it, bit for bit."""
    mixed = restored(cache, "int:2,kbits=8,layers=v1:8|zstd:3")
    wide, narrow = restored(cache, "int:8|zstd:3"), restored(cache, "int:2|zstd:3")
    for (layer, kind), array in mixed.items():
        expected = wide if kind == "k" or layer == 1 else narrow
        assert np.array_equal(array.view(np.uint16), expected[layer, kind].view(np.uint16)), (layer, kind)
    assert not np.array_equal(wide[0, "v"].view(np.uint16), narrow[0, "v"].view(np.uint16))


def test_narrower_tensors_store_less(cache):
    """The codes plane has room for the widest tensor; a narrower one's zero tail costs the codec next to nothing."""
    one_width = len(encode_cache(cache, "int:4,group=64|zstd:3"))
    keys_wider = len(encode_cache(cache, "int:4,group=64,kbits=6|zstd:3"))
    everything_wider = len(encode_cache(cache, "int:6,group=64|zstd:3"))
    assert one_width < keys_wider < everything_wider
    assert keys_wider - one_width < 0.6 * (everything_wider - one_width)


def test_widths_parse_print_and_refuse():
    layout = get_layout("int:4,group=64,kbits=6,layers=k0:8+v3:5")
    assert layout.spec() == "int:4,group=64,kbits=6,layers=k0:8+v3:5"
    assert layout.get_config()["layers"] == "k0:8+v3:5"
    assert [layout.for_kind(kind, layer).code_bits for kind, layer in [("k", 0), ("k", 1), ("v", 3), ("v", 0)]] == [8, 6, 5, 4]
    assert get_layout("int:4,kbits=4,vbits=0").code_bits == 4  # a width equal to the others is no width of its own
    for bad in ("int:4,kbits=9", "int:4,layers=x0:8", "int:4,layers=k0:9", "int:4,layers=k0:0", "int:4,layers=k:8",
                "int:4,layers=k0:8+k0:6", "int:4,layers=k0"):
        with pytest.raises(UsageError):
            get_layout(bad)


def test_a_tensor_of_unknown_width_is_refused():
    block = np.ones((1, 4, 8), np.float32)
    with pytest.raises(UsageError, match="needs to know which tensor"):
        get_layout("int:4,k=token,kbits=6").forward([block])  # which kind
    with pytest.raises(UsageError, match="needs to know which tensor"):
        get_layout("int:4,layers=k0:8").for_kind("v").forward([block])  # which layer
    assert get_layout("int:4,kbits=6").for_kind("v").forward([block])  # a kind's width needs no layer


@pytest.mark.skipif(_native.core() is None, reason=f"native core: {_native.status()}")
@pytest.mark.parametrize("kind,layer", [("k", 0), ("k", 1), ("v", 0), ("v", 1)])
def test_core_and_reference_agree_on_every_width(cache, kind, layer):
    layout = IntQuant(3, group=16, kbits=5, layers="k1:8+v1:1").for_kind(kind, layer)
    block = np.ascontiguousarray((cache.keys if kind == "k" else cache.values)[layer][:, :77])
    native, reference = layout._native_forward(block), layout.reference_forward(block)
    assert native is not None
    for ours, theirs in zip(native, reference):
        assert np.array_equal(ours.view(np.uint8), theirs.view(np.uint8))
    spec = PlaneSpec.of(block)
    out = np.empty(spec.shape, spec.dtype)
    assert layout._native_inverse(native, spec, out)
    assert np.array_equal(out.view(np.uint16), layout.reference_inverse(native, spec).view(np.uint16))
