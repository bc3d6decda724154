"""The LMCache adapter's pure parts, without LMCache: how a chunk becomes a cache and comes back, keys, options.

The adapter itself runs against LMCache's real classes in tests/lmcache_e2e.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvtool
from kvtool.errors import UsageError
from kvtool.integrations.lmcache.chunks import ChunkLayout, restore_chunk
from kvtool.entries import Miss, Restored, put_cache
from kvtool.entries.names import ChunkName
from kvtool.store import Store, open_store
from kvtool.integrations.lmcache.settings import AdapterSettings


def lmcache_chunk(sample: str, kv: int = 2) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    """A real sample as LMCache's chunk bytes: ``[2, layers, tokens, heads*dim]``, or ``kv`` = 1 with K|V per token."""
    cache = kvtool.load(f"samples/{sample}")
    k = np.stack([a.transpose(1, 0, 2).reshape(cache.num_tokens, -1) for a in cache.keys])
    v = np.stack([a.transpose(1, 0, 2).reshape(cache.num_tokens, -1) for a in cache.values])
    if kv == 2:
        array = np.stack([k, v])
    else:  # vLLM's CPU build: each token's row holds K and V of every head
        array = np.concatenate([k, v], axis=2)[None]
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8), [array.shape]


def put_chunk(store: Store, data: np.ndarray, layout: ChunkLayout, recipe: str) -> int:
    """Store one object's bytes as the adapter does; the record's size."""
    put = put_cache(store, "chunk", layout.cache(data, "m"), recipe)
    assert put.stored, put.detail
    return put.stored_bytes


def load_chunk(store: Store, layout: ChunkLayout, out: np.ndarray) -> Restored:
    return restore_chunk(store, "chunk", layout, out)


@pytest.mark.parametrize("sample", ["code.safetensors", "prose.safetensors"])
@pytest.mark.parametrize("kv", [2, 1])
@pytest.mark.parametrize("recipe", ["exphuff", "zstd:3", "none"])
def test_a_chunk_comes_back_bit_for_bit(sample, kv, recipe):
    data, shapes = lmcache_chunk(sample, kv)
    layout = ChunkLayout.of(shapes, ["torch.bfloat16"], data.nbytes)
    assert layout.kind == ("kv" if kv == 2 else "blocks") and layout.nbytes == data.nbytes
    out = np.full_like(data, 0xA5)
    with open_store("memory://") as store:
        size = put_chunk(store, data, layout, recipe)
        assert load_chunk(store, layout, out).ok
    assert out.tobytes() == data.tobytes()
    if recipe == "exphuff":
        assert size * 1.3 < data.nbytes  # real KV, channels lined up: the default recipe's ratio


def test_k_and_v_of_a_layer_are_that_layers_k_and_v():
    data, shapes = lmcache_chunk("code.safetensors")
    layout = ChunkLayout.of(shapes, ["torch.bfloat16"], data.nbytes)
    cache = layout.cache(data, "m")
    sample = kvtool.load("samples/code.safetensors")
    for layer in (0, 17):
        for mine, theirs in ((cache.keys[layer], sample.keys[layer]), (cache.values[layer], sample.values[layer])):
            assert mine.tobytes() == np.ascontiguousarray(theirs.transpose(1, 0, 2)).tobytes()


def test_rows_cover_every_byte_once():
    layout = ChunkLayout("kv", "bf16", 3, 5, 4)
    rows = layout.rows().reshape(-1)
    assert sorted(rows.tolist()) == list(range(0, layout.nbytes, 8))


@pytest.mark.parametrize("shapes,dtypes,nbytes", [
    ([(262144,)], ["torch.uint8"], 262144),  # LMCache's benchmark payload
    ([(1, 3, 16, 8)], ["torch.bfloat16"], 3 * 16 * 8 * 2),  # an odd number of blocks
    ([(2, 2, 16, 8), (2, 2, 16, 8)], ["torch.bfloat16"] * 2, 2 * 2 * 2 * 16 * 8 * 2),  # two kernel groups
    ([(2, 2, 16, 8)], ["torch.int8"], 2 * 2 * 16 * 8),  # a dtype kvtool does not code
])
def test_anything_else_is_kept_as_bytes(shapes, dtypes, nbytes):
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    layout = ChunkLayout.of(shapes, dtypes, nbytes)
    assert layout.kind == "bytes" and layout.nbytes == nbytes
    out = np.zeros_like(data)
    with open_store("memory://") as store:
        put_chunk(store, data, layout, "exphuff")
        assert load_chunk(store, layout, out).ok
    assert out.tobytes() == data.tobytes()


@pytest.mark.parametrize("nbytes", [0, 1, 2, 7, 13, 4097, 262145])
@pytest.mark.parametrize("recipe", ["exphuff", "zstd:3"])
def test_any_size_is_kept_bit_for_bit_even_odd_and_empty(nbytes, recipe):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    layout = ChunkLayout.of([(nbytes,)], ["torch.uint8"], nbytes)
    assert layout.kind == "bytes" and layout.nbytes == nbytes and layout.tail == nbytes % 2
    out = np.full_like(data, 0xA5)
    with open_store("memory://") as store:
        put_chunk(store, data, layout, recipe)
        assert load_chunk(store, layout, out).ok
    assert out.tobytes() == data.tobytes()


def test_an_odd_object_never_restores_into_an_even_one_or_back():
    data = np.arange(13, dtype=np.uint8)
    odd, even = ChunkLayout.of([(13,)], ["torch.uint8"], 13), ChunkLayout.of([(12,)], ["torch.uint8"], 12)
    assert odd.expected() == even.expected()  # the same blocks: only the tail tells them apart
    with open_store("memory://") as store:
        put_chunk(store, data, odd, "exphuff")
        out = np.zeros(12, np.uint8)
        assert load_chunk(store, even, out).miss is Miss.MISMATCH and not out.any()
        put_chunk(store, data[:12], even, "exphuff")
        assert load_chunk(store, odd, np.zeros(13, np.uint8)).miss is Miss.MISMATCH
    with pytest.raises(UsageError):
        ChunkLayout.of([(7,)], ["torch.uint8"], -1)


def test_another_layout_is_a_mismatch_and_damage_is_an_error():
    data, shapes = lmcache_chunk("prose.safetensors")
    layout = ChunkLayout.of(shapes, ["torch.bfloat16"], data.nbytes)
    half = ChunkLayout(layout.kind, layout.dtype, layout.layers, layout.tokens // 2, layout.width)
    with open_store("memory://") as store:
        put_chunk(store, data, layout, "exphuff")
        assert load_chunk(store, half, np.zeros(half.nbytes, np.uint8)).miss is Miss.MISMATCH
        record = bytearray(store.read_record("chunk"))
        record[len(record) // 2] ^= 1
        store.write_record("chunk", bytes(record))
        assert load_chunk(store, layout, np.zeros_like(data)).miss is Miss.DAMAGED
        assert not store.contains("chunk")  # a damaged entry is dropped


def test_every_field_of_the_key_and_the_recipe_name_another_entry():
    base = ChunkName(b"\x01" * 16, "org/model", 0, 0, "", "exphuff")
    others = [ChunkName(b"\x02" * 16, "org/model", 0, 0, "", "exphuff"), ChunkName(b"\x01" * 16, "org/other", 0, 0, "", "exphuff"),
              ChunkName(b"\x01" * 16, "org/model", 1, 0, "", "exphuff"), ChunkName(b"\x01" * 16, "org/model", 0, 1, "", "exphuff"),
              ChunkName(b"\x01" * 16, "org/model", 0, 0, "tenant", "exphuff"),
              ChunkName(b"\x01" * 16, "org/model", 0, 0, "", "int:4,group=64|zstd:3")]
    assert len({base.key, *(o.key for o in others)}) == 7


def test_a_name_comes_back_from_its_metadata_only_under_its_own_key():
    name = ChunkName(b"\x07" * 32, "org/model", 3, 1, "tenant-a", "exphuff")
    meta = name.meta()
    assert ChunkName.from_meta(name.key, meta) == name
    assert ChunkName.from_meta(ChunkName(b"\x08" * 32, "org/model", 3, 1, "tenant-a", "exphuff").key, meta) is None
    tampered = {**meta, "lmcache": {**meta["lmcache"], "salt": "tenant-b"}}
    assert ChunkName.from_meta(name.key, tampered) is None
    assert ChunkName.from_meta(name.key, {"lmcache": {**meta["lmcache"], "kv_rank": "3"}}) is None


def test_settings(tmp_path):
    assert AdapterSettings.from_params({"store": "memory://"}) == AdapterSettings("memory://")
    kvd = tmp_path / "m.kvd"
    kvd.write_bytes(b"")  # the file is read when the adapter starts, not here
    for recipe in ("ctxans", "ctxtans"):
        assert AdapterSettings.from_params({"store": "memory://", "recipe": recipe, "dictionary": str(kvd)}).dictionary == str(kvd)
    with pytest.raises(UsageError):
        AdapterSettings.from_params({"store": "memory://", "recipe": "exphuff", "dictionary": str(kvd)})
    assert AdapterSettings.from_params({"store": "memory://", "recipe": "zstd:3", "workers": 4}).workers == 4
    for params in ({}, {"store": ""}, {"store": "memory://", "recipe": 3}, {"store": "memory://", "workers": True},
                   {"store": "memory://", "dictionary": "missing.kvd"}, {"store": "memory://", "colour": "red"}):
        with pytest.raises(UsageError):
            AdapterSettings.from_params(params)
