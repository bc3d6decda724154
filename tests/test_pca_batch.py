"""The ``pca`` stage's batch restore: the bytes of the per-chunk path and of the numpy reference, into every
destination, on the real samples with a basis learnt from the other; damage refused as the per-chunk path does."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kvtool import _native
from kvtool.cache import KVCache, ModelFacts
from kvtool.errors import DecodeError
from kvtool.kvz import KvzCorruptError, KvzReader, encode_cache
from kvtool.kvz.pca_pipeline import PcaBatch
from kvtool.kvz.pipeline import PerChunk
from kvtool.layouts import get_layout
from kvtool.layouts import pca_reference as ref
from kvtool.layouts.base import PlaneSpec
from kvtool.modeldict import registry
from kvtool.modeldict.basis import BasisDictionary
from kvtool.modeldict.basis_train import train_basis

from native_checks import needs_core, vector_levels

SPECS = ["step=0.3", "kstep=0.1,vstep=0.6,sink=0", "bits=2.5,sink=16", "step=3,recent=40"]


@pytest.fixture
def basis(pca_basis) -> BasisDictionary:
    registry.register(pca_basis)
    return pca_basis


@pytest.fixture(scope="module")
def code(samples) -> KVCache:
    return KVCache.load(samples[0], layers=[0, 3, 17, 29])


def per_chunk(blob: bytes) -> KvzReader:
    reader = KvzReader.from_bytes(blob)
    reader._pipeline = PerChunk(reader.header)
    return reader


def cast(cache: KVCache, dtype) -> KVCache:
    return KVCache([k.astype(dtype) for k in cache.keys], [v.astype(dtype) for v in cache.values], cache.model,
                   layer_ids=cache.layer_ids, token_start=cache.token_start)


@needs_core
@pytest.mark.parametrize("spec", SPECS)
def test_batch_restores_the_per_chunk_and_reference_bytes(basis, code, spec, monkeypatch):
    blob = encode_cache(code, f"pca:{basis.id},{spec}|zstd:1", chunk_tokens=100)  # a last block of another size
    reader = KvzReader.from_bytes(blob)
    assert isinstance(reader._pipeline, PcaBatch)
    restored = reader.read(threads=2)
    assert restored.equal_bits(per_chunk(blob).read())
    some = {"layers": [3, 29], "tokens": slice(37, 211)}  # begins and ends inside blocks
    assert KvzReader.from_bytes(blob).read(**some).equal_bits(per_chunk(blob).read(**some))
    monkeypatch.setattr(_native, "core", lambda: None)  # the numpy reference, per chunk
    registry.register(basis)
    with KvzReader.from_bytes(blob) as reference:
        assert type(reference._pipeline) is PerChunk
        assert reference.read().equal_bits(restored)


@needs_core
@pytest.mark.parametrize("dtype", [np.float16, np.float32, ml_dtypes.bfloat16])
def test_every_dtype_the_stage_takes_from_a_later_position(basis, code, dtype):
    cache = cast(KVCache(code.keys, code.values, code.model, layer_ids=code.layer_ids, token_start=300), dtype)
    blob = encode_cache(cache, f"pca:{basis.id},step=0.4|zstd:1", chunk_tokens=64)
    assert isinstance(KvzReader.from_bytes(blob)._pipeline, PcaBatch)
    assert KvzReader.from_bytes(blob).read(threads=3).equal_bits(per_chunk(blob).read())


@needs_core
def test_rows_left_out_and_rows_anywhere(basis, code):
    """Rows at random places of one target, the first tokens left out (-1): the bytes of ``read``, nothing else."""
    blob = encode_cache(code, f"pca:{basis.id},step=0.3|zstd:1", chunk_tokens=48)
    expected = np.stack([a for _, _, a in KvzReader.from_bytes(blob).read().tensors()])
    n, heads, tokens, dim = expected.shape
    order = np.random.default_rng(3).permutation(n * heads * tokens).reshape(n, heads, tokens).astype(np.int64)
    rows = order * dim * expected.itemsize
    rows[:, :, :10] = -1
    target = np.zeros(n * heads * tokens * dim, expected.dtype)
    with KvzReader.from_bytes(blob) as reader:
        assert isinstance(reader._pipeline, PcaBatch)
        reader.read_rows([target], rows, [0] * n)
    got = target.reshape(-1, dim)[order.reshape(-1)].reshape(expected.shape)
    assert np.array_equal(got[:, :, 10:].view(np.uint16), expected[:, :, 10:].view(np.uint16))
    assert not got[:, :, :10].view(np.uint16).any()


@needs_core
@pytest.mark.parametrize("where", ["stored", "zstd frame"])
def test_damage_is_refused_as_the_per_chunk_path_refuses_it(basis, code, where):
    blob = bytearray(encode_cache(code, f"pca:{basis.id},step=0.3|zstd:1", chunk_tokens=128))
    with KvzReader.from_bytes(bytes(blob)) as reader:
        entry = reader.index[5]
    at = int(entry["offset"]) + (int(entry["stored_len"]) // 2 if where == "stored" else 0)
    blob[at] ^= 0x40
    messages = []
    for open_reader in (lambda b: KvzReader.from_bytes(b), per_chunk):
        with pytest.raises(KvzCorruptError) as caught:
            open_reader(bytes(blob)).read()
        messages.append(str(caught.value))
    assert messages[0] == messages[1] and "checksum mismatch" in messages[0]


@needs_core
@pytest.mark.parametrize("heads, dim", [(2, 20), (5, 48), (1, 8)])
def test_geometries_past_every_vector_width(heads, dim, monkeypatch):
    """Token widths (40, 240, 8 values) that leave the decoder's 32-, 16- and 8-wide sums a tail, and token counts
    that leave its batches of tokens part full: the core's bytes are the reference's at every vector level."""
    rng = np.random.default_rng(heads * dim)
    mixing = rng.normal(size=(heads * dim, heads * dim)) * np.exp(-np.arange(heads * dim) / 6)[:, None]

    def cache(tokens: int) -> KVCache:
        def tensor() -> np.ndarray:
            values = (rng.normal(size=(tokens, heads * dim)) @ mixing).reshape(tokens, heads, dim).transpose(1, 0, 2)
            return np.ascontiguousarray(values).astype(ml_dtypes.bfloat16)
        return KVCache([tensor(), tensor()], [tensor(), tensor()], ModelFacts("synthetic"))

    dictionary = train_basis([cache(600)], rope_theta=1e4)
    registry.register(dictionary)
    blob = encode_cache(cache(203), f"pca:{dictionary.id},step=0.2,sink=3|zstd:1", chunk_tokens=64)
    restored = {}
    with KvzReader.from_bytes(blob) as reader:
        assert isinstance(reader._pipeline, PcaBatch)
        for level in vector_levels():
            restored[level] = reader.read()
    with monkeypatch.context() as m:  # the numpy reference
        m.setattr(_native, "core", lambda: None)
        registry.register(dictionary)
        expected = KvzReader.from_bytes(blob).read()
    assert restored and all(cache.equal_bits(expected) for cache in restored.values())


@needs_core
def test_damaged_planes_are_refused_or_restored_alike_by_the_reference_and_every_core_level(basis, code):
    """Random bytes of coded planes flipped: the numpy reference and the core, at each vector level, refuse the
    same planes and restore the others to the same bytes."""
    rng = np.random.default_rng(11)
    outcomes = {"refused": 0, "restored": 0}
    for kind, layer in (("k", 3), ("v", 17)):
        stage = get_layout(f"pca:{basis.id},step=0.3").for_kind(kind, layer).for_block(40, 1 << 20)
        block = np.ascontiguousarray((code.keys if kind == "k" else code.values)[code.layer_ids.index(layer)][:, 40:120])
        (plane,) = stage.forward([block])
        spec = PlaneSpec.of(block)
        used = int(np.flatnonzero(plane).max()) + 1  # the coded content; the rest of the plane is zero room
        for _ in range(60):
            damaged = plane.copy()
            at = int(rng.integers(0, used))
            damaged[at] ^= np.uint8(1 << int(rng.integers(0, 8)))
            try:
                expected = ref.decode(damaged, stage.tensor(), spec.shape, spec.dtype).tobytes()
            except DecodeError:
                expected = None
            for level in vector_levels():
                try:
                    got = stage.inverse([damaged], [spec])[0].tobytes()
                except DecodeError:
                    got = None
                assert got == expected, (at, level)
            outcomes["refused" if expected is None else "restored"] += 1
    assert outcomes["refused"] and outcomes["restored"]  # both kinds of damage were met
