"""Golden .kvz files written by earlier versions must keep decoding to the same cache."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvtool.kvz import open_kvz
from kvtool.layouts.lossy import bound_violation
from kvtool.recipe import Recipe

sys.path.insert(0, str(Path(__file__).parent / "golden"))
from make_golden import ARRAY_RECIPES, GOLDEN, HERE, LOSSY_DIGESTS, LOSSY_RECIPES, decoded_digests, golden_cache  # noqa: E402


def test_every_golden_file_is_present():
    assert sorted(p.name for p in HERE.glob("*.kvz")) == sorted(f"v1-{n.replace(':', '')}.kvz" for n in GOLDEN)


@pytest.mark.parametrize("name", sorted(GOLDEN.keys() - LOSSY_RECIPES.keys()))
def test_golden_file_decodes_bit_exactly(name):
    with open_kvz(HERE / f"v1-{name.replace(':', '')}.kvz") as reader:
        reader.verify(full=True)
        assert reader.recipe == Recipe.parse(GOLDEN[name])
        assert reader.read().equal_bits(golden_cache())


def test_array_codec_golden_files_hold_coded_chunks():
    """They pin the coded format, not the stored-raw fallback."""
    for name in ARRAY_RECIPES:
        with open_kvz(HERE / f"v1-{name}.kvz") as reader:
            assert not any(reader.index["flags"]) and len(reader.index)


@pytest.mark.parametrize("name, version", [("array-ctxtans", 1), ("array-ctxtans-2", 2), ("array-ctxtans-3", 3)])
def test_ctxtans_golden_files_pin_each_chunk_version(name, version):
    """Every chunk of each file is of the version it was written for; the keys' chunks coded with the dictionary
    (mode 0), the values' with their own statistics (mode 1: 12 tokens of values are too few for the dictionary)."""
    path = HERE / f"v1-{name}.kvz"
    data = path.read_bytes()
    with open_kvz(path) as reader:
        heads = {bytes(data[o : o + 2]) for o in reader.index["offset"].tolist()}
    assert heads == {bytes([version, 0]), bytes([version, 1])}


@pytest.mark.parametrize("name", sorted(LOSSY_RECIPES))
def test_lossy_golden_file_decodes_to_the_same_approximation(name):
    """The same bits as when it was written, and within the stage's bound of the original."""
    with open_kvz(HERE / f"v1-{name}.kvz") as reader:
        reader.verify(full=True)
        assert reader.recipe == Recipe.parse(GOLDEN[name]) and reader.recipe.lossy
        restored = reader.read()
        original = golden_cache()
        assert decoded_digests(restored) == json.loads(LOSSY_DIGESTS.read_text())[name]
        assert not restored.equal_bits(original)
        stored = [array for _, _, array in restored.tensors()]
        assert bound_violation(original.tensors(), stored, reader.recipe.layouts, reader.chunk_tokens) is None
