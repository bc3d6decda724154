"""Lossy stages: bounded on real caches, labelled wherever they show, never a default, never a lossless hit."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
from typer.testing import CliRunner

from kvtool.bench import recipes as recipe_sets
from kvtool.bench.accuracy import DEFAULT_RECIPES
from kvtool.bench.matrix import measure
from kvtool.cache import DTYPES, KVCache
from kvtool.cli import app
from kvtool.kvz import KvzCorruptError, KvzFormatError, KvzReader, decode_cache, encode_cache
from kvtool.errors import UsageError
from kvtool.integrations.vllm.settings import ConnectorSettings
from kvtool.layouts import get_layout, parse_layouts, registry
from kvtool.layouts.base import PlaneSpec
from kvtool.layouts.lossy import bound_violation
from kvtool.recipe import DEFAULT_RECIPE, Recipe
from kvtool.store import PrefixKeyer
from kvtool.store.memory import MemoryStore
from kvtool.testing.lossy import LossyLayoutTests, assert_within_bound

LOSSY_LAYOUTS = [
    "mant-round:3", "mant-round:0", "mant-round:12", "fp8:e4m3", "fp8:e5m2,group=7",
    "int:4", "int:8,group=64", "int:1,group=5", "int:3,k=token,v=channel,group=48",
    "int:4,group=64,kbits=6,vbits=3,layers=k1:8+v0:2", "int:3,group=64,codes=ctx",
    "int:4,group=64,kbits=6,layers=k1:8+v0:2,codes=ctx",
]
LOSSY_RECIPES = [
    "mant-round:4|byteplane|zstd:3", "fp8:e4m3|exphuff", "fp8:e5m2,group=64|byteplane|zstd:1",
    "int:4|zstd:3", "int:6,group=64|channel-major|zstd:1,scales=none",
    "int:4,group=64,kbits=6,layers=k1:8+v14:2|zstd:3", "outliers:0.01|int:3,group=128|zstd:3,outlier.val=none",
    "int:3,group=64,codes=ctx|zstd:3", "int:4,group=64,kbits=6,layers=k1:8+v14:2,codes=ctx|zstd:3",
]


@pytest.fixture(scope="module")
def small(samples) -> KVCache:
    """Four layers, 300 tokens (a partial last chunk) of both real samples, end to end."""
    caches = [KVCache.load(p, layers=[0, 1, 14, 29]) for p in samples[:2]]
    join = lambda parts: [np.concatenate(t, axis=1)[:, :300] for t in zip(*parts)]  # noqa: E731
    return KVCache(join([c.keys for c in caches]), join([c.values for c in caches]), caches[0].model, layer_ids=[0, 1, 14, 29])


class TestLossyLayouts(LossyLayoutTests):
    @pytest.fixture(params=LOSSY_LAYOUTS)
    def layout(self, request):
        return get_layout(request.param)

    @pytest.fixture
    def kv_arrays(self, real_arrays):
        return real_arrays


def test_every_lossy_layout_is_covered():
    """Every lossy stage runs the conformance suite: here, or in tests/test_pca.py (TestPcaConformance) for ``pca``,
    which codes with a transform dictionary learnt there."""
    lossy = {i for i in registry.ids() if registry.get(i).lossy}
    assert lossy == {"mant-round", "fp8", "int", "pca"}
    assert {spec.partition(":")[0] for spec in LOSSY_LAYOUTS} | {"pca"} == lossy


# -- the stages against independent references -----------------------------------------------


def test_mant_round_matches_the_fp8_and_bf16_casts(real_arrays):
    """Rounding bf16 to 2 or 3 mantissa bits is the fp8 cast where fp8 holds the value; fp32 to 7 is the bf16 cast."""
    values = np.concatenate([a.reshape(-1) for a in real_arrays]).astype(np.float32)
    for bits, fp8 in ((2, ml_dtypes.float8_e5m2), (3, ml_dtypes.float8_e4m3fn)):
        info = ml_dtypes.finfo(fp8)
        x = values[(np.abs(values) >= float(info.smallest_normal)) & (np.abs(values) <= float(info.max))]
        bf16 = x.astype(ml_dtypes.bfloat16)
        (rounded,) = get_layout(f"mant-round:{bits}").forward([bf16])
        assert np.array_equal(rounded.astype(np.float32), bf16.astype(np.float32).astype(fp8).astype(np.float32))
    (rounded,) = get_layout("mant-round:7").forward([values])
    assert np.array_equal(rounded, values.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_mant_round_keeps_the_largest_values_finite():
    top = np.array([[[float(ml_dtypes.finfo(ml_dtypes.bfloat16).max), -1.0]]], ml_dtypes.bfloat16)
    (rounded,) = get_layout("mant-round:0").forward([top])
    assert np.isfinite(rounded.astype(np.float32)).all()
    assert_within_bound(get_layout("mant-round:0"), top, "k")


def test_fp8_plane_holds_scale_rows_and_cast_values(real_arrays):
    """Each group's scale row holds e with max|x| * 2**-e in (max/2, max], and below it the values x * 2**-e cast to fp8."""
    block = real_arrays[3][:, :40]
    layout = get_layout("fp8:e4m3,group=16")
    (plane,) = layout.forward([block])
    assert plane.shape == (block.shape[0], 40 + 3, block.shape[2])
    fmax = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    bits = plane.view(np.uint8)
    for group, start in enumerate(range(0, 40, 16)):
        row = start + group
        exponents = bits[:, row].view(np.int8).astype(np.int32)
        values = block[:, start : start + 16].astype(np.float64)
        largest = np.abs(values).max(axis=1)
        assert (np.ldexp(largest, -exponents) <= fmax).all() and (np.ldexp(largest, 1 - exponents) > fmax).all()
        stored = plane[:, row + 1 : row + 1 + values.shape[1]]
        expected = np.ldexp(values, -exponents[:, None, :]).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
        assert np.array_equal(stored.view(np.uint8), expected.view(np.uint8))


def test_int_error_is_half_a_step_of_its_group(real_arrays):
    """Per group, the error is at most (max - min) / (2**bits - 1) / 2, up to the rounding of fp16 scales and the output."""
    block = real_arrays[1][:, :96]
    for bits in (2, 4, 8):
        layout = get_layout(f"int:{bits},k=channel,group=32").for_kind("k")
        (restored,) = layout.inverse(layout.forward([block]), [PlaneSpec.of(block)])
        values = block.astype(np.float64).transpose(0, 2, 1).reshape(block.shape[0], block.shape[2], 3, 32)
        error = np.abs(restored.astype(np.float64) - block.astype(np.float64)).transpose(0, 2, 1).reshape(values.shape)
        step = (values.max(-1) - values.min(-1)) / ((1 << bits) - 1)
        slack = 1e-3 * step + 2.0 ** -8 * np.abs(values).max(-1)  # fp16 scale rounding, then bf16 output rounding
        assert (error.max(-1) <= step / 2 + slack).all()


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_int_planes_are_as_documented(real_arrays, bits, axis):
    """Decoding by the module docstring's words (codes packed most significant bit first as np.packbits
    does, a (scale, min) pair per group in its stated order) gives the layout's own inverse."""
    block = real_arrays[0][:, :100]  # the last group of 64 tokens is short
    heads, tokens, dim = block.shape
    layout = get_layout(f"int:{bits},k={axis},v={axis},group=64")
    codes_plane, scales = layout.forward([block])
    assert codes_plane.size == -(-heads * tokens * dim * bits // 8)
    code_bits = np.unpackbits(codes_plane)[: heads * tokens * dim * bits].reshape(-1, bits).astype(np.uint32)
    codes = (code_bits << np.arange(bits - 1, -1, -1, dtype=np.uint32)).sum(axis=1).reshape(block.shape)
    t, d = np.meshgrid(np.arange(tokens), np.arange(dim), indexing="ij")
    group = d * -(-tokens // 64) + t // 64 if axis == "channel" else t * -(-dim // 64) + d // 64
    pairs = scales[:, group].astype(np.float32)  # [heads, tokens, dim, 2]
    expected = (codes.astype(np.float32) * pairs[..., 0] + pairs[..., 1]).astype(block.dtype)
    (restored,) = layout.inverse([codes_plane, scales], [PlaneSpec.of(block)])
    assert np.array_equal(restored.view(np.uint16), expected.view(np.uint16))
    error = np.abs(expected.astype(np.float64) - block.astype(np.float64))
    assert (error <= layout.error_bound(block)).all()


def test_int_quantizes_keys_and_values_along_their_own_axes(real_arrays):
    block = real_arrays[2]
    kivi = get_layout("int:4")  # keys per channel, values per token
    for kind, axis in (("k", "channel"), ("v", "token")):
        alone = get_layout(f"int:4,k={axis},v={axis}")
        ours, theirs = kivi.for_kind(kind).forward([block]), alone.forward([block])
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs))
    assert not np.array_equal(kivi.for_kind("k").forward([block])[0], kivi.for_kind("v").forward([block])[0])
    with pytest.raises(UsageError, match="needs to know which"):
        kivi.forward([block])


def test_specs_parse_and_print():
    assert get_layout("int:4,k=channel,v=token,group=32").spec() == "int:4"
    assert get_layout("int").spec() == "int:4"
    assert get_layout("int:8,group=64").spec() == "int:8,group=64"
    assert get_layout("fp8:e5m2,group=16").get_config() == {"id": "fp8", "format": "e5m2", "group": 16}
    assert Recipe.parse("int:4,group=64|zstd:3,scales=none").spec() == "int:4,group=64|zstd:3,scales=none"
    for bad in ("int:9", "int:4,colour=red", "int:4,group=0", "int:4,k=row", "fp8:e3m4", "mant-round:x", "int:4,4", "int:4,bits=4"):
        with pytest.raises(UsageError):
            get_layout(bad)


def test_a_lossy_stage_comes_first_and_alone():
    with pytest.raises(UsageError, match="first stage"):
        Recipe.parse("channel-major|int:4|zstd:3")
    with pytest.raises(UsageError, match="first stage"):
        Recipe.parse("mant-round:4|fp8:e4m3|exphuff")
    assert Recipe.parse("fp8:e4m3|exphuff").lossy and not Recipe.parse("byteplane|zstd:1").lossy


# -- the container ---------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", LOSSY_RECIPES)
def test_lossy_recipes_through_the_container(small, recipe):
    parsed = Recipe.parse(recipe)
    blob = encode_cache(small, parsed, chunk_tokens=128)
    with KvzReader.from_bytes(blob) as reader:
        reader.verify(full=True)
        restored = reader.read()
        marker = reader.lossy
    assert restored.dtype == small.dtype and restored.keys[0].shape == small.keys[0].shape
    assert bound_violation(small.tensors(), [a for _, _, a in restored.tensors()], parsed.layouts, 128) is None
    assert not restored.equal_bits(small)
    assert len(blob) < len(encode_cache(small, DEFAULT_RECIPE))
    errors = {(e["layer"], e["kind"]): e for e in marker["error"]}
    assert set(errors) == {(layer, kind) for layer, kind, _ in small.tensors()}
    for (layer, kind, original), (_, _, approx) in zip(small.tensors(), restored.tensors()):
        error = approx.astype(np.float64) - original.astype(np.float64)
        assert errors[(layer, kind)]["max_abs"] == pytest.approx(np.abs(error).max(), rel=1e-5)
        assert errors[(layer, kind)]["rms"] == pytest.approx(np.sqrt(np.mean(error ** 2)), rel=1e-5)


@pytest.mark.parametrize("recipe", [r for r in LOSSY_RECIPES if "codes=ctx" in r])
def test_coded_int_codes_store_the_packed_recipes_approximation(small, recipe):
    """codes=ctx changes how the codes are stored, not which: the restored arrays are codes=packed's, byte for byte."""
    coded = decode_cache(encode_cache(small, recipe, chunk_tokens=128))
    assert coded.equal_bits(decode_cache(encode_cache(small, recipe.replace(",codes=ctx", ""), chunk_tokens=128)))


@pytest.mark.parametrize("stage, lossless", [("mant-round:4", "byteplane|zstd:3"), ("fp8:e4m3", "zstd:3")])
def test_the_array_codec_after_a_lossy_stage_stores_the_same_approximation(small, stage, lossless):
    """exphuff codes the float plane that mant-round and fp8 leave, bit for bit as a bytes codec does."""
    with_array_codec = decode_cache(encode_cache(small, f"{stage}|exphuff", chunk_tokens=128))
    with_bytes_codec = decode_cache(encode_cache(small, f"{stage}|{lossless}", chunk_tokens=128))
    assert with_array_codec.equal_bits(with_bytes_codec) and not with_array_codec.equal_bits(small)


def test_integer_codes_are_no_block_for_the_array_codec(small):
    with pytest.raises(UsageError, match=r"takes one \[heads, tokens, dim\] block; its layouts leave \['codes', 'scales'\]"):
        encode_cache(small, "int:4|exphuff")


@pytest.mark.parametrize("recipe", ["int:4|zstd:3", "fp8:e4m3|exphuff", "outliers:0.02|int:3|zstd:3"])
def test_rows_of_a_lossy_entry_are_the_approximation_it_reads_back(small, recipe):
    """read_rows, the connector's restore into paged blocks, gives what read gives."""
    heads, tokens, dim = small.keys[0].shape
    targets = [np.zeros((2, heads, tokens, dim), small.dtype.numpy) for _ in small.layer_ids]
    rows = np.stack([(np.arange(heads * tokens, dtype=np.int64) * dim * 2).reshape(heads, tokens) + kv * heads * tokens * dim * 2
                     for _ in small.layer_ids for kv in (0, 1)])
    with KvzReader.from_bytes(encode_cache(small, recipe, chunk_tokens=128)) as reader:
        reader.read_rows(targets, rows, [i // 2 for i in range(rows.shape[0])])
        restored = reader.read()
    for target, key, value in zip(targets, restored.keys, restored.values):
        assert np.array_equal(target[0].view(np.uint16), key.view(np.uint16))
        assert np.array_equal(target[1].view(np.uint16), value.view(np.uint16))
    assert not restored.equal_bits(small)


def test_the_container_tells_a_tensor_its_kind(small):
    blob = encode_cache(small, "int:4|zstd:3", chunk_tokens=300)
    restored = decode_cache(blob)
    layout = get_layout("int:4")
    for (_, kind, original), (_, _, approx) in zip(small.tensors(), restored.tensors()):
        for binding in ("k", "v"):
            stage = layout.for_kind(binding)
            (expected,) = stage.inverse(stage.forward([original]), [PlaneSpec.of(original)])
            assert np.array_equal(approx.view(np.uint16), expected.view(np.uint16)) == (binding == kind)


def test_checksums_cover_the_stored_approximation(small):
    blob = bytearray(encode_cache(small, "int:4|zstd:3"))
    with KvzReader.from_bytes(bytes(blob)) as reader:
        middle = int(reader.index["offset"][5] + reader.index["stored_len"][5] // 2)
    blob[middle] ^= 0x40
    with KvzReader.from_bytes(bytes(blob)) as reader, pytest.raises(KvzCorruptError, match="checksum"):
        reader.verify()


def test_the_lossy_marker_is_there_exactly_when_the_recipe_is_lossy(small):
    from test_container import _rewrite_header

    assert KvzReader.from_bytes(encode_cache(small, DEFAULT_RECIPE)).lossy is None
    blob = encode_cache(small, "int:4|zstd:3")
    header = bytes(blob[16 : 16 + struct.unpack_from("<I", blob, 12)[0]])
    assert json.loads(header)["lossy"]["error"]
    unmarked = _rewrite_header(blob, header.replace(b'"lossy":', b'"lossz":'))
    with pytest.raises(KvzFormatError, match="lossy"):
        decode_cache(unmarked)


# -- never a default, never a lossless hit -----------------------------------------------------


def test_nothing_lossy_is_a_default(samples):
    assert not Recipe.parse(DEFAULT_RECIPE).lossy
    assert not Recipe.parse(ConnectorSettings().recipe).lossy
    assert not Recipe.parse(DEFAULT_RECIPES[0]).lossy  # the accuracy bench's lossless reference
    cache = KVCache.load(samples[0], layers=[0])
    for recipes in (recipe_sets.quick(cache), recipe_sets.everything(cache)):
        assert recipes and not any(parse_layouts(r.rpartition("|")[0]).lossy for r in recipes)


def test_a_lossy_entry_never_answers_a_lossless_lookup(small):
    store = MemoryStore(capacity=1 << 30)
    tokens = list(range(1000, 1300))
    lossy = PrefixKeyer("smollm2", Recipe.parse("int:4|zstd:3").spec(), chunk_tokens=128)
    lossless = PrefixKeyer("smollm2", Recipe.parse(DEFAULT_RECIPE).spec(), chunk_tokens=128)
    chunks = [encode_cache(small.select(tokens=slice(s, s + 128)), "int:4|zstd:3") for s in range(0, 300, 128)]
    assert store.put_prefix(lossy, tokens, chunks) == 3
    assert store.get_prefix(lossless, tokens).tokens == 0
    assert store.get_prefix(lossy, tokens).tokens == 300
    assert not set(lossy.keys(tokens)) & set(lossless.keys(tokens))


# -- labelled in every output ------------------------------------------------------------------


def test_cli_labels_lossy_files(samples, tmp_path):
    runner = CliRunner()
    kvz, out = tmp_path / "c.kvz", tmp_path / "c.safetensors"
    result = runner.invoke(app, ["compress", str(samples[0]), str(kvz), "--recipe", "fp8:e4m3|exphuff"])
    assert result.exit_code == 0 and "lossy recipe 'fp8:e4m3|exphuff'" in result.stderr

    shown = runner.invoke(app, ["inspect", str(kvz)])
    assert shown.exit_code == 0 and "lossy       yes: stage fp8:e4m3" in shown.stdout
    assert "error of the lossy stage" in shown.stdout
    report = json.loads(runner.invoke(app, ["inspect", str(kvz), "--json"]).stdout)
    assert report["lossy"]["stage"] == "fp8:e4m3" and len(report["lossy"]["error"]) == 60
    assert report["original_bytes"] / report["file_bytes"] > 2
    assert json.loads(runner.invoke(app, ["inspect", str(samples[0]), "--json"]).stdout).get("lossy") is None

    verified = runner.invoke(app, ["verify", "--full", str(kvz)])
    assert verified.exit_code == 0 and "lossy recipe" in verified.stdout
    assert json.loads(runner.invoke(app, ["verify", str(kvz), "--json"]).stdout)["lossy"] is True

    decompressed = runner.invoke(app, ["decompress", str(kvz), str(out)])
    assert decompressed.exit_code == 0 and "approximation" in decompressed.stderr
    approx = KVCache.load(out)
    assert approx.num_tokens == KVCache.load(samples[0]).num_tokens
    assert approx.provenance["lossy_recipe"] == "fp8:e4m3|exphuff"


def test_reorder_refuses_a_lossy_layout(samples, tmp_path):
    result = CliRunner().invoke(app, ["reorder", str(samples[0]), str(tmp_path / "r.safetensors"), "--layout", "mant-round:3"])
    assert result.exit_code == UsageError.exit_code and "lossy" in result.stderr


def test_bench_compression_labels_lossy_recipes(small):
    result = measure(small, "int:4|zstd:3", threads=1, repeat=1)
    assert result.lossy and result.ratio > 3
    assert not measure(small, DEFAULT_RECIPE, threads=1, repeat=1).lossy


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_other_float_caches_take_lossy_recipes(small, dtype):
    cast = KVCache([k.astype(np.float32).astype(DTYPES[dtype].numpy) for k in small.keys],
                   [v.astype(np.float32).astype(DTYPES[dtype].numpy) for v in small.values], small.model,
                   layer_ids=small.layer_ids)
    for recipe in ("int:8,group=64|zstd:3", "fp8:e4m3|exphuff", "mant-round:5|byteplane|zstd:3"):
        parsed = Recipe.parse(recipe)
        restored = decode_cache(encode_cache(cast, parsed))
        assert restored.dtype.name == dtype
        assert bound_violation(cast.tensors(), [a for _, _, a in restored.tensors()], parsed.layouts, 256) is None


def test_fp8_caches_refuse_lossy_recipes(small):
    fp8 = KVCache([k.astype(np.float32).astype(ml_dtypes.float8_e4m3fn) for k in small.keys],
                  [v.astype(np.float32).astype(ml_dtypes.float8_e4m3fn) for v in small.values], small.model)
    with pytest.raises(UsageError, match="fp8_e4m3"):
        encode_cache(fp8, "int:4|zstd:3")
