"""Model dictionaries: the .kvd format, training, lookup by id, the CLI, the store and the vLLM connector's keeper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtool.cache import KVCache, ModelFacts
from kvtool.codecs import get_codec
from kvtool.kvz import KvzReader, decode_cache, encode_cache
from kvtool.errors import DecodeError, UsageError
from kvtool.modeldict import registry
from kvtool.modeldict.format import PROB_SCALE, Dictionary, DictionaryError
from kvtool.modeldict.train import train
from kvtool.integrations.vllm.dictionary import dictionaries_of
from kvtool.store import dicts, open_store

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def code_dict(samples) -> Dictionary:
    """A small dictionary learnt from the code sample only (8 classes, to keep the tests quick)."""
    return train([KVCache.load(samples[0], layers=list(range(0, 30, 3)))], classes=8)


@pytest.fixture
def isolated_registry(monkeypatch, tmp_path):
    """A registry that knows nothing but the shipped dictionary, with an empty dictionary path."""
    monkeypatch.setattr(registry, "_known", {})
    monkeypatch.setattr(registry, "_files", {})
    monkeypatch.setattr(registry, "_sources", [])
    monkeypatch.setenv(registry.PATH_VARIABLE, str(tmp_path / "nowhere"))
    return registry


def kvd_file(dictionary: Dictionary, directory: Path) -> Path:
    path = directory / "model.kvd"
    path.write_bytes(dictionary.to_bytes())
    return path


# -- the format ------------------------------------------------------------------------------


def test_a_dictionary_reads_back_with_the_same_id_and_tables(code_dict):
    again = Dictionary.from_bytes(code_dict.to_bytes())
    assert again.id == code_dict.id and again.payload == code_dict.payload
    assert np.array_equal(again.freq, code_dict.freq)
    assert code_dict.classes == 8 and code_dict.meta["trained_on"][0]["text"] == "functools.py.txt"
    assert np.all(code_dict.freq.astype(np.int64).sum(axis=2) == PROB_SCALE)


def test_damaged_dictionaries_are_refused(code_dict):
    data = code_dict.to_bytes()
    for bad in (data[:10], data[:-1], b"\x89KVZ" + data[4:], data[:8] + b"\x02" + data[9:]):
        with pytest.raises(DictionaryError):
            Dictionary.from_bytes(bad)
    payload = bytearray(code_dict.payload)
    payload[-1] ^= 0xFF  # a frequency table that no longer sums to PROB_SCALE
    with pytest.raises(DictionaryError):
        Dictionary.from_payload(bytes(payload))


def test_training_is_deterministic(samples):
    cache = KVCache.load(samples[1], layers=[0, 1])
    assert train([cache], classes=4).id == train([KVCache.load(samples[1], layers=[0, 1])], classes=4).id


def test_the_shipped_dictionary_is_found_and_is_the_default():
    codec = get_codec("ctxans")
    assert codec.dict == registry.default_id() == registry.load(registry.DEFAULT_FILE).id
    assert codec.spec() == f"ctxans:{codec.dict}"


# -- coding with dictionaries --------------------------------------------------------------


def test_a_dictionary_of_other_text_round_trips_bit_exactly(samples, code_dict, tmp_path):
    """Trained on code, used on prose: only the ratio moves."""
    path = kvd_file(code_dict, tmp_path)
    prose = KVCache.load(samples[1], layers=[0, 7, 29])
    blob = encode_cache(prose, f"ctxans:{path}")
    assert decode_cache(blob).equal_bits(prose)
    with KvzReader.from_bytes(blob) as reader:
        assert reader.recipe.codec.get_config() == {"id": "ctxans", "dict": code_dict.id}
    assert len(blob) < 0.66 * prose.nbytes


def test_decoding_without_the_dictionary_is_a_clean_error(samples, code_dict, isolated_registry, tmp_path):
    registry.register(code_dict)
    cache = KVCache.load(samples[0], layers=[3])
    blob = encode_cache(cache, f"ctxans:{code_dict.id[:10]}")
    isolated_registry._known.clear()
    with pytest.raises(registry.MissingDictionaryError, match=code_dict.id):
        decode_cache(blob)
    kvd_file(code_dict, tmp_path)  # now on the dictionary path
    os.environ[registry.PATH_VARIABLE] = str(tmp_path)
    assert decode_cache(blob).equal_bits(cache)


def test_a_chunk_of_another_dictionary_is_refused(samples, code_dict):
    block = KVCache.load(samples[0], layers=[3]).keys[0]
    registry.register(code_dict)
    chunk = get_codec(f"ctxans:{code_dict.id}").encode_array(block)
    with pytest.raises(DecodeError, match="another dictionary"):
        get_codec("ctxans").decode_array(chunk, block.shape, block.dtype)


def test_recipes_name_dictionaries_by_file_id_or_prefix(code_dict, tmp_path):
    path = kvd_file(code_dict, tmp_path)
    assert get_codec(f"ctxans:{path}").dict == code_dict.id
    assert get_codec(f"ctxans:{code_dict.id[:12]}").dict == code_dict.id
    for bad in ("ctxans:zz", "ctxans:abc", f"ctxans:{tmp_path / 'missing.kvd'}"):
        with pytest.raises(UsageError):
            get_codec(bad)
    unknown = "0123456789" if not code_dict.id.startswith("0123456789") else "9876543210"
    with pytest.raises(registry.MissingDictionaryError, match=unknown):
        get_codec(f"ctxans:{unknown}")


# -- the command line -------------------------------------------------------------------------


def kvtool(*args, env=None, check=True):
    return subprocess.run([sys.executable, "-m", "kvtool", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, check=check)


def test_train_compress_and_decompress_from_the_command_line(samples, tmp_path):
    kvd = tmp_path / "code.kvd"
    report = json.loads(kvtool("train", samples[0], "-o", kvd, "--classes", "4", "--json").stdout)
    assert report["id"] == Dictionary.from_bytes(kvd.read_bytes()).id and report["bytes"] == kvd.stat().st_size
    (tmp_path / "elsewhere").mkdir()
    kvz, back = tmp_path / "elsewhere" / "prose.kvz", tmp_path / "back.safetensors"
    kvtool("compress", samples[1], kvz, "--recipe", f"ctxans:{kvd}")
    elsewhere = {registry.PATH_VARIABLE: str(tmp_path / "empty")}
    failed = kvtool("decompress", kvz, back, env=elsewhere, check=False)
    assert failed.returncode == 3 and "Traceback" not in failed.stderr
    assert failed.stderr.count("\n") == 1 and report["id"] in failed.stderr and "--dict FILE.kvd" in failed.stderr
    kvtool("decompress", kvz, back, env={registry.PATH_VARIABLE: str(tmp_path)})
    assert KVCache.load(back).equal_bits(KVCache.load(samples[1]))


def test_trains_advice_works_as_printed(samples, tmp_path):
    """`kvtool train` says how to use the dictionary and how readers find it; each way works, from a
    fresh process, wherever the .kvz lies."""
    out = tmp_path / "out"
    out.mkdir()
    printed = kvtool("train", samples[0], "-o", out / "smol.kvd", "--classes", "4").stdout
    recipe = printed.split("Use it as --recipe ")[1].split(";")[0].strip("'")
    assert recipe == f"ctxans:{out}/smol.kvd"
    nowhere = {registry.PATH_VARIABLE: str(tmp_path / "nowhere")}
    kvz = out / "code.kvz"
    kvtool("compress", samples[1], kvz, "--recipe", recipe, env=nowhere)
    original = KVCache.load(samples[1])
    back = tmp_path / "back.safetensors"
    kvtool("decompress", kvz, back, env=nowhere)  # the .kvd beside the .kvz
    assert KVCache.load(back).equal_bits(original)
    (tmp_path / "moved").mkdir()
    moved = (tmp_path / "moved" / "code.kvz")
    moved.write_bytes(kvz.read_bytes())
    assert kvtool("verify", moved, "--full", env=nowhere, check=False).returncode == 3
    assert "with --dict " + str(out / "smol.kvd") in printed
    for how, env in ((["--dict", out / "smol.kvd"], nowhere), ([], {registry.PATH_VARIABLE: str(out)})):
        assert kvtool("verify", moved, "--full", *how, env=env).returncode == 0
        back.unlink()
        kvtool("decompress", moved, back, *how, env=env)
        assert KVCache.load(back).equal_bits(original)
    again = kvtool("train", moved, "-o", tmp_path / "again.kvd", "--classes", "4", "--dict", out / "smol.kvd", env=nowhere)
    assert again.returncode == 0
    bad = kvtool("decompress", moved, back, "--dict", samples[0], env=nowhere, check=False)
    assert bad.returncode == 2 and "is not a model dictionary" in bad.stderr


# -- stores -------------------------------------------------------------------------------------


def test_a_store_keeps_a_dictionary_once_and_readers_find_it(samples, code_dict, isolated_registry, tmp_path):
    cache = KVCache.load(samples[1], layers=[0, 29])
    with open_store(f"file://{tmp_path / 'store'}") as store:
        registry.register(code_dict)
        recipe = f"ctxans:{code_dict.id}"
        assert dicts.publish_all(store, dictionaries_of(recipe)) and dicts.publish_all(store, dictionaries_of(recipe))
        store.put("entry/1", encode_cache(cache, recipe))
        store.put("entry/2", encode_cache(cache, recipe))
        assert sorted(store.keys()) == ["entry/1", "entry/2", dicts.key_of(code_dict.id)]
    isolated_registry._known.clear()  # a reader in another process
    with open_store(f"file://{tmp_path / 'store'}") as store:
        with pytest.raises(registry.MissingDictionaryError):
            decode_cache(store.get("entry/1"))
        registry.attach(dicts.source(store))
        assert decode_cache(store.get("entry/2")).equal_bits(cache)
        registry.detach(dicts.source(store))
    assert dicts.fetch(open_store("memory://"), code_dict.id) is None


def test_a_damaged_dictionary_in_a_store_is_not_used(code_dict, isolated_registry):
    with open_store("memory://") as store:
        store.put(dicts.key_of(code_dict.id), code_dict.to_bytes()[:-3])
        registry.attach(dicts.source(store))
        with pytest.raises(registry.MissingDictionaryError):
            registry.lookup(code_dict.id)
        registry.detach(dicts.source(store))


# -- the vLLM connector's dictionary ------------------------------------------------------------


@pytest.mark.parametrize("codec", ["ctxans", "ctxtans"])
def test_the_connector_learns_a_dictionary_from_its_first_entries(samples, isolated_registry, codec):
    from kvtool.integrations.vllm.dictionary import DictionaryKeeper
    from kvtool.kvz.header import _facts as header_facts

    cache = KVCache.load(samples[0], layers=[0, 1, 2])
    halves = [cache.select(tokens=slice(0, 128)), cache.select(tokens=slice(128, 256))]
    with open_store("memory://") as store:
        keeper = DictionaryKeeper("train:256", codec, store, ModelFacts("m"))
        default = keeper.recipe
        assert keeper.recipe_for(halves[0].keys, halves[0].values) == default
        assert keeper.recipe_for(halves[1].keys, halves[1].values) == default  # learning starts now
        for thread in [t for t in __import__("threading").enumerate() if t.name == "kvtool-train"]:
            thread.join()
        learnt = keeper.recipe
        assert learnt != default and learnt.partition(":")[0] == codec
        assert store.contains(dicts.key_of(learnt.partition(":")[2]))
        blob = encode_cache(halves[0], learnt)
        assert decode_cache(blob).equal_bits(halves[0])
    isolated_registry._known.clear()  # a process that has never seen the dictionary
    header_facts.cache_clear()  # nor read a header that names it
    with pytest.raises(registry.MissingDictionaryError):
        decode_cache(blob)


@pytest.mark.parametrize("codec", ["ctxans", "ctxtans"])
def test_the_connector_loads_a_given_dictionary_and_checks_its_options(code_dict, tmp_path, codec):
    from kvtool.integrations.vllm.dictionary import DictionaryKeeper
    from kvtool.integrations.vllm.settings import ConnectorSettings

    path = kvd_file(code_dict, tmp_path)
    settings = ConnectorSettings.from_extra_config({"recipe": codec, "dictionary": str(path)})
    with open_store("memory://") as store:
        keeper = DictionaryKeeper(settings.dictionary, settings.recipe, store, ModelFacts("m"))
        assert keeper.recipe == f"{codec}:{code_dict.id}" and store.contains(dicts.key_of(code_dict.id))
    for bad in ({"dictionary": str(path)}, {"recipe": "exphuff", "dictionary": str(path)}, {"recipe": "ctxans", "dictionary": "train:x"},
                {"recipe": "ctxans", "dictionary": str(tmp_path / "none.kvd")}, {"recipe": "ctxans", "dictionary": 3}):
        with pytest.raises(UsageError):
            ConnectorSettings.from_extra_config(bad)
