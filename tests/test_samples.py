"""The committed samples are real SmolLM2-135M caches that say how they were made."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvtool.cache import KVCache

SAMPLES = Path(__file__).resolve().parents[1] / "samples"


def test_both_samples_are_committed(samples):
    assert {p.stem for p in samples} >= {"code", "prose"}


@pytest.mark.parametrize("name", ["code", "prose"])
def test_sample_is_a_smollm2_cache_with_provenance(name):
    cache = KVCache.load(SAMPLES / f"{name}.safetensors")
    assert cache.dtype.name == "bf16"
    assert cache.layer_ids == list(range(30)) and cache.token_start == 0
    assert {a.shape for a in cache.keys + cache.values} == {(3, 256, 64)}
    assert cache.bytes_per_token == 23040
    facts = cache.model
    assert facts.model_id.startswith("SmolLM2-135M")
    assert (facts.architecture, facts.num_layers, facts.num_kv_heads, facts.head_dim) == ("llama", 30, 3, 64)
    assert facts.keys_post_rope is True
    prov = cache.provenance
    assert prov["model_id"] == facts.model_id
    assert prov["token_count"] == 256
    assert len(prov["token_ids_hash"]) == 16
    assert prov["dtype"] == "bf16" and prov["compute_dtype"] == "fp32"
    assert prov["next_token_accuracy"] > 0.3


@pytest.mark.parametrize("name", ["code", "prose"])
def test_sample_text_is_committed_unchanged(name):
    prov = KVCache.load(SAMPLES / f"{name}.safetensors").provenance
    text = SAMPLES / "texts" / prov["text_name"]
    assert hashlib.sha256(text.read_bytes()).hexdigest() == prov["text_sha256"]


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2", "fp16", "fp32"])
def test_other_dtypes_save_and_load(samples, tmp_path, dtype):
    """Caches of every dtype round-trip through safetensors, whole and sliced."""
    from kvtool.cache import DTYPES

    source = KVCache.load(samples[0], layers=[0, 1], tokens=slice(0, 40))
    cast = KVCache(
        [k.astype(DTYPES[dtype].numpy) for k in source.keys], [v.astype(DTYPES[dtype].numpy) for v in source.values],
        source.model, source.provenance, layer_ids=source.layer_ids,
    )
    path = tmp_path / f"{dtype}.safetensors"
    cast.save(path)
    assert KVCache.load(path).equal_bits(cast)
    assert KVCache.load(path, layers=[1], tokens=slice(5, 17)).equal_bits(cast.select([1], slice(5, 17)))
