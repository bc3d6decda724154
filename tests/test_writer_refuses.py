"""A writer refuses what its readers would refuse: nothing kvtool writes is a file it cannot read back."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open
from typer.testing import CliRunner

from kvtool.cache import MAX_LAYER_ID, KVCache
from kvtool.cli import app
from kvtool.errors import UsageError
from kvtool.kvz import decode_cache, encode_cache

runner = CliRunner()


def _tensor(shape: tuple[int, int, int]) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape).astype(ml_dtypes.bfloat16)


def test_a_layer_id_past_the_readers_bound_is_refused_at_compress(tmp_path):
    src, dst = tmp_path / "big-layer.safetensors", tmp_path / "big-layer.kvz"
    KVCache([_tensor((2, 4, 8))], [_tensor((2, 4, 8))]).save(src)
    with safe_open(src, "np") as f:  # the same cache, its layer renamed past the readers' bound
        metadata = f.metadata()
        tensors = {name.replace("layer.0.", f"layer.{10**30}."): f.get_tensor(name) for name in f.keys()}
    safetensors.numpy.save_file(tensors, src, metadata=metadata)
    result = runner.invoke(app, ["compress", str(src), str(dst)])
    assert result.exit_code != 0
    assert f"a layer id must be an integer in 0..{MAX_LAYER_ID}" in result.output
    assert not dst.exists()


@pytest.mark.parametrize("layer_ids", [[MAX_LAYER_ID + 1], [-1], [True], [3, 3]])
def test_a_cache_with_layer_ids_no_reader_takes_cannot_be_made(layer_ids):
    tensors = [_tensor((2, 4, 8)) for _ in layer_ids]
    with pytest.raises(UsageError, match="layer id"):
        KVCache(tensors, [t.copy() for t in tensors], layer_ids=layer_ids)


def test_the_largest_layer_id_round_trips():
    cache = KVCache([_tensor((2, 4, 8))], [_tensor((2, 4, 8))], layer_ids=[MAX_LAYER_ID])
    assert decode_cache(encode_cache(cache)).equal_bits(cache)


@pytest.mark.parametrize("shape", [(0, 16, 64), (2, 16, 0)])
def test_a_cache_without_heads_or_head_dim_is_not_written(shape):
    """Its decode would refuse it (no row fits): the writer says so first, in one line."""
    cache = KVCache([_tensor(shape)], [_tensor(shape)])
    with pytest.raises(UsageError, match="at least one head"):
        encode_cache(cache)


def test_a_cache_without_tokens_still_round_trips():
    cache = KVCache([_tensor((2, 0, 64))], [_tensor((2, 0, 64))])
    assert decode_cache(encode_cache(cache)).equal_bits(cache)
