"""Two connector instances on one Redis Cluster, driven the way vLLM drives them (no vLLM needed).

Instance A computes a prompt and saves its entries; instance B, with a store
client of its own (another server), finds the stored prefix and restores it
into other paged blocks, bit for bit. A different cache_salt (folded into vLLM's
block hashes) or another model never hits.
"""

from __future__ import annotations

import uuid

import pytest

from kvtool.cache import ModelFacts
from kvtool.integrations.vllm.plan import SaveJob, entries_to_save, load_jobs
from kvtool.store import open_store
from kvtool.entries.names import EntryNamer, find_stored_prefix

torch = pytest.importorskip("torch", reason="the paged-tensor helpers need torch (pip install 'kvtool[model]')")

from kvtool.integrations.vllm.transfer import Capture, Restore, encode_and_store  # noqa: E402
from test_vllm_connector import cpu_paged, layers_of  # noqa: E402

BLOCK = 4
PER_ENTRY = 2
RECIPE = "byteplane|zstd:1"
PROMPT_BLOCKS = 5  # 20 prompt tokens in 5 full blocks (cpu_paged has 6 blocks per layer)
NUM_LAYERS = 3


def block_hashes(salt: int = 0) -> list[bytes]:
    """Stand-ins for vLLM's chained block hashes; vLLM folds a request's cache_salt into them."""
    return [bytes([i + salt]) * 32 for i in range(PROMPT_BLOCKS + 1)]


def namer(model: str = "smollm2") -> EntryNamer:
    return EntryNamer(model, RECIPE, "torch.bfloat16", block_size=BLOCK)


def instance_a_computes_and_saves(store, tensors, block_ids) -> int:
    """Scheduler: plan the saves of a computed prompt; worker: capture every layer, encode, store."""
    names = namer()
    spans = entries_to_save(block_hashes(), PROMPT_BLOCKS, PROMPT_BLOCKS, 0, PER_ENTRY, names)
    saves = {"req-a": [SaveJob(span.entry_id, block_ids[span.start:span.end]) for span in spans]}
    layers = layers_of(tensors)
    capture = Capture(saves, NUM_LAYERS)
    for index in range(NUM_LAYERS):  # save_kv_layer, once per layer in the forward pass
        capture.take_layer(index, layers)
    entries = capture.complete_entries(set())  # wait_for_save
    for entry_id, _, keys, values in entries:
        assert encode_and_store(store, names.key(entry_id, 0), keys, values, RECIPE, ModelFacts("smollm2"))
    return len(entries)


def instance_b_restores(store, tensors, block_ids, salt=0, model="smollm2") -> tuple[int, set[int]]:
    """Scheduler: look the prompt up (get_num_new_matched_tokens), plan loads; worker: restore layer by layer."""
    names = namer(model)
    prompt_tokens = PROMPT_BLOCKS * BLOCK + 1  # one more token than the stored prompt
    spans = find_stored_prefix(block_hashes(salt), (prompt_tokens - 1) // BLOCK, PER_ENTRY, names, store.contains_many)
    restored = spans[-1].end if spans else 0
    jobs = load_jobs(spans, 0, block_ids, restored)
    if not jobs:
        return 0, set()
    restore = Restore(store, lambda entry_id: names.key(entry_id, 0), layers_of(tensors), {"req-b": jobs})
    restore.start(background=False)
    for index in range(NUM_LAYERS):  # wait_for_layer_load
        restore.copy_layer(index)
    return restored, restore.finish()


def test_instance_b_restores_the_prefix_instance_a_stored(redis_cluster_url):
    url = f"{redis_cluster_url}?prefix=kvtool-test-vllm-{uuid.uuid4().hex[:12]}:&ttl=600"
    source = [cpu_paged() + layer for layer in range(NUM_LAYERS)]
    a_blocks = [0, 1, 2, 3, 4]
    b_blocks = [5, 3, 1, 0, 2]  # B's block manager hands out other blocks
    target = [torch.zeros_like(t) for t in source]
    with open_store(url) as store_a:
        assert instance_a_computes_and_saves(store_a, source, a_blocks) == 3  # 2 + 2 + a short last entry of 1
    with open_store(url) as store_b:
        assert instance_b_restores(store_b, [torch.zeros_like(t) for t in source], b_blocks, salt=100) == (0, set())
        assert instance_b_restores(store_b, [torch.zeros_like(t) for t in source], b_blocks, model="other") == (0, set())
        restored, failed = instance_b_restores(store_b, target, b_blocks)
        assert (restored, failed) == (PROMPT_BLOCKS, set())
        assert store_b.stats()["hits"] == 3
        for layer in range(NUM_LAYERS):
            for a, b in zip(a_blocks, b_blocks):
                assert torch.equal(target[layer][b], source[layer][a])
        for key in store_b.keys():
            store_b.delete(key)
