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
