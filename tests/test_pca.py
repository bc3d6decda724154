"""The ``pca`` stage: real caches through a basis learnt from another text, C and the numpy reference byte for byte,
the lossy conformance suite, exact tokens, dictionaries that are missing or belong to another model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtool import _native
from kvtool.cache import DTYPES, KVCache
from kvtool.codecs import get_codec
from kvtool.entries import recipe_problem
from kvtool.errors import DecodeError, UsageError
from kvtool.kvz import KvzReader, encode_cache
from kvtool.layouts import get_layout
from kvtool.layouts import pca_reference as ref
from kvtool.layouts.base import PlaneSpec
from kvtool.layouts.lossy import bound_violation
from kvtool.layouts.pca import Pca
from kvtool.modeldict import registry
from kvtool.modeldict.basis import BasisDictionary
from kvtool.modeldict.registry import MissingDictionaryError
from kvtool.recipe import Recipe
from kvtool.testing.lossy import LossyLayoutTests

from native_checks import vector_levels

GOLDEN = Path(__file__).parent / "golden"
needs_core = pytest.mark.skipif(_native.core() is None, reason="the native core is not built: the reference is tested alone")


@pytest.fixture
def basis(pca_basis) -> BasisDictionary:
    registry.register(pca_basis)  # again: a test may have set another registry's contents
    return pca_basis


@pytest.fixture(scope="module")
def code(samples) -> KVCache:
    return KVCache.load(samples[0])


def bound(dictionary: BasisDictionary, spec: str, kind: str, layer: int, position: int = 0, end: int = 1 << 20):
    return get_layout(f"pca:{dictionary.id},{spec}").for_kind(kind, layer).for_block(position, end)


class TestPcaConformance(LossyLayoutTests):
    @pytest.fixture
    def layout(self, basis):
        return get_layout(f"pca:{basis.id},step=0.3")

    @pytest.fixture
    def kv_arrays(self, code):
        return [code.keys[0][:, :64], code.values[1][:, 100:201]]


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("spec", ["step=0.3", "kstep=0.1,vstep=0.6,sink=0", "bits=2.5,sink=16", "step=3"])
@needs_core
def test_core_writes_and_reads_the_reference_bytes(basis, code, dtype, spec):
    for layer in (0, 13, 29):
        for kind in "kv":
            array = (code.keys if kind == "k" else code.values)[layer].astype(np.float32).astype(DTYPES[dtype].numpy)
            for position, block in ((0, array[:, :100]), (100, array[:, 100:]), (3 << 30, array[:, 7:8]), (9, array[:, :0])):
                stage = bound(basis, spec, kind, layer, position, position + block.shape[1] + 5)
                (plane,) = stage.forward([block])
                tensor = stage.tensor()
                exact = stage.exact_tokens(block.shape[1])
                assert np.array_equal(plane, ref.encode(np.ascontiguousarray(block), tensor, position, exact, plane.size))
                spec_ = PlaneSpec.of(block)
                expected = ref.decode(plane, tensor, spec_.shape, spec_.dtype).tobytes()
                for _ in vector_levels():  # the decoder: portable C, and AVX2 and AVX-512 where the CPU has them
                    restored = stage.inverse([plane], [spec_])[0]
                    assert restored.tobytes() == expected
                error = np.abs(restored.astype(np.float64) - block.astype(np.float64))
                assert (error <= stage.error_bound(np.ascontiguousarray(block))).all()


def test_a_container_round_trip_keeps_sink_and_recent_tokens_exact(basis, code):
    cache = KVCache(code.keys[:2], code.values[:2], code.model, layer_ids=[0, 1], token_start=0)
    blob = encode_cache(cache, f"pca:{basis.id},step=0.4,sink=4,recent=10|zstd:1", chunk_tokens=64)
    with KvzReader.from_bytes(blob) as reader:
        restored = reader.read()
        assert reader.lossy is not None and len(reader.lossy["error"]) == 4
    for (_, _, original), (_, _, back) in zip(cache.tensors(), restored.tensors()):
        assert np.array_equal(back[:, :4].view(np.uint16), original[:, :4].view(np.uint16))
        assert np.array_equal(back[:, -10:].view(np.uint16), original[:, -10:].view(np.uint16))
        assert not np.array_equal(back[:, 4:-10].view(np.uint16), original[:, 4:-10].view(np.uint16))
    stored = [a for _, _, a in restored.tensors()]
    assert bound_violation(cache.tensors(), stored, Recipe.parse(f"pca:{basis.id},step=0.4,sink=4,recent=10|zstd:1").layouts,
                           64) is None


def test_positions_after_the_start_of_a_sequence(basis, code):
    """A slice later in a sequence: no token before ``sink`` there, and the keys turn by their own positions."""
    cache = KVCache(code.keys[:1], code.values[:1], code.model, token_start=5000)
    recipe = f"pca:{basis.id},step=0.3|zstd:1"
    with KvzReader.from_bytes(encode_cache(cache, recipe, chunk_tokens=128)) as reader:
        restored = reader.read()
    first = restored.keys[0][:, :4].view(np.uint16)
    assert not np.array_equal(first, code.keys[0][:, :4].view(np.uint16))
    stored = [a for _, _, a in restored.tensors()]
    assert bound_violation(cache.tensors(), stored, Recipe.parse(recipe).layouts, 128, token_start=5000) is None


def test_the_reference_alone_restores_what_the_core_wrote(basis, code, monkeypatch):
    recipe = f"pca:{basis.id},step=0.3|zstd:1"
    cache = KVCache(code.keys[28:], code.values[28:], code.model, layer_ids=[28, 29])
    blob = encode_cache(cache, recipe, chunk_tokens=128)
    with KvzReader.from_bytes(blob) as reader:
        native = reader.read()
    monkeypatch.setattr(_native, "core", lambda: None)
    fresh = get_layout(f"pca:{basis.id},step=0.3")  # coders built anew, without the core
    assert fresh.for_kind("k", 28).tensor().native is None
    with KvzReader.from_bytes(blob) as reader:
        assert reader.read().equal_bits(native)
    assert encode_cache(cache, recipe, chunk_tokens=128) == blob


def test_rate_target_picks_a_step_from_the_calibration(basis):
    coarse, fine = (get_layout(f"pca:{basis.id},bits={b}") for b in (1.0, 4.0))
    assert coarse.describe()["steps"]["k"] > fine.describe()["steps"]["k"]
    assert set(coarse.describe()["steps"].values()) <= {float(s) for s in basis.steps}


def test_a_step_gives_keys_and_values_their_own(basis):
    stage = get_layout(f"pca:{basis.id},step=0.3,vstep=0.5")
    assert stage.describe()["steps"] == {"k": 0.3, "v": 0.5}
    assert stage.spec() == f"pca:{basis.id},step=0.3,vstep=0.5"


def test_bad_parameters_are_refused(basis):
    for spec in ("", "step=0.3,bits=2", "step=-1", "step=100", "sink=-1", "step=nan", "step=0.3,other=1"):
        with pytest.raises(UsageError):
            get_layout(f"pca:{basis.id},{spec}" if spec else f"pca:{basis.id}")
    with pytest.raises(UsageError, match="32 hex"):
        Pca(dict="xyz", step=0.3)


def test_a_missing_dictionary_is_one_clear_error(code):
    missing = "0123456789abcdef0123456789abcdef"
    cache = KVCache(code.keys[:1], code.values[:1], code.model)
    with pytest.raises(MissingDictionaryError, match=f"dictionary {missing} is not known here"):
        encode_cache(cache, f"pca:{missing},step=0.3|zstd:1")


def test_a_file_whose_dictionary_is_gone_says_so(basis, code, monkeypatch):
    blob = encode_cache(KVCache(code.keys[:1], code.values[:1], code.model), f"pca:{basis.id},step=0.3|zstd:1")
    monkeypatch.setattr(registry, "_known", {})
    monkeypatch.setattr(registry, "search_path", list)
    with KvzReader.from_bytes(blob) as reader, pytest.raises(MissingDictionaryError, match=basis.id):
        reader.read()


def test_a_dictionary_of_another_model_is_refused(basis, code):
    other = KVCache([a[:2, :, :32].copy() for a in code.keys[:1]], [a[:2, :, :32].copy() for a in code.values[:1]])
    with pytest.raises(UsageError, match="another model"):
        encode_cache(other, f"pca:{basis.id},step=0.3|zstd:1")
    beyond = KVCache(code.keys[:1], code.values[:1], code.model, layer_ids=[40])
    with pytest.raises(UsageError, match="no basis for layer 40"):
        encode_cache(beyond, f"pca:{basis.id},step=0.3|zstd:1")


def test_a_context_codec_refuses_a_transform_dictionary(basis, code):
    with pytest.raises(UsageError, match="transform bases"):
        encode_cache(KVCache(code.keys[:1], code.values[:1]), f"ctxans:{basis.id}")


@pytest.mark.parametrize("damage", ["mode", "version", "tag", "components", "tail", "stream", "bitmap", "position"])
def test_malformed_planes_are_refused_by_both(basis, code, damage, monkeypatch):
    stage = bound(basis, "step=0.3", "k", 3)
    block = code.keys[3][:, :40]
    (plane,) = stage.forward([block])
    plane = plane.copy()
    stream = ref.HEAD.size + 5 + 4 * block.shape[0] * block.shape[2] * 2  # the head, the bitmap, 4 sink tokens
    at = {"mode": 0, "version": 1, "tag": 4, "components": 2, "tail": plane.size - 1, "stream": stream + 40,
          "bitmap": ref.HEAD.size, "position": 15}[damage]
    plane[at] ^= 0x80 if damage != "bitmap" else 0x01
    spec = PlaneSpec.of(block)
    with pytest.raises(DecodeError):
        ref.decode(plane, stage.tensor(), spec.shape, spec.dtype)
    if stage.tensor().native is not None:
        with pytest.raises(DecodeError):
            stage.inverse([plane], [spec])


def test_dictionary_bytes_round_trip_and_refusals(basis):
    again = BasisDictionary.from_bytes(basis.to_bytes())
    assert again.id == basis.id and again.payload == basis.payload
    assert registry.parse(basis.to_bytes()).id == basis.id
    payload = bytearray(basis.payload)
    with pytest.raises(DecodeError):
        BasisDictionary.from_payload(bytes(payload[:-2]))
    tables = basis.class_tables.copy()
    tables[0, 0] += 1
    with pytest.raises(DecodeError, match="sum"):
        BasisDictionary(basis.heads, basis.dim, basis.frequencies, basis.steps, basis.class_model, tables, basis.tensors)
    with pytest.raises(DecodeError, match="order"):
        BasisDictionary(basis.heads, basis.dim, basis.frequencies, basis.steps, basis.class_model, basis.class_tables,
                        basis.tensors[::-1])


def test_the_golden_file_holds_coded_planes():
    """It pins the coded plane (mode 1, sink tokens in the first blocks), not the fallback that stores a block as is."""
    with KvzReader.from_bytes((GOLDEN / "v1-lossy-pca.kvz").read_bytes()) as reader:
        registry.load(GOLDEN / "pca-basis.kvd")
        planes = []
        data = (GOLDEN / "v1-lossy-pca.kvz").read_bytes()
        zstd = get_codec("zstd:1")
        for entry in reader.index:
            stored = data[int(entry["offset"]) : int(entry["offset"]) + int(entry["stored_len"])]
            planes.append(stored if entry["flags"] & 1 else zstd.decode(stored, max_size=int(entry["raw_len"])))
    assert all(plane[0] == ref.MODE_CODED for plane in planes)
    exact = [int.from_bytes(plane[24:28], "little") for plane in planes]
    assert exact == [2 if entry["token_start"] == 0 else 0 for entry in reader.index]


def test_the_connectors_probe_codes_blocks_of_the_models_shape(basis):
    """vLLM's connector probes its recipe before the first prompt: a pca recipe keeps the model it was learnt for."""
    recipe = f"pca:{basis.id},step=0.32|zstd:1"
    assert recipe_problem(recipe, "bf16", heads=3, dim=64) is None
    assert "a dictionary of another model" in recipe_problem(recipe, "bf16")
