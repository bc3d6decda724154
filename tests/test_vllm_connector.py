"""The vLLM connector's pure-Python parts, with fake block hashes and fake paged tensors (no vLLM needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtool.cache import ModelFacts
from kvtool.errors import UsageError
from kvtool.kvz import KvzReader
from kvtool.integrations.vllm.plan import LoadJob, SaveJob, entries_to_save, load_jobs
from kvtool.integrations.vllm.settings import ConnectorSettings
from kvtool.integrations.vllm.stats import StatsCollector, merge, summary
from kvtool.store import open_store
from kvtool.entries.names import EntryNamer, find_stored_prefix, tokens_in

torch = pytest.importorskip("torch", reason="the paged-tensor helpers need torch (pip install 'kvtool[model]')")

from kvtool.integrations.vllm.paged import gather_blocks, kv_views, scatter_blocks  # noqa: E402
from kvtool.integrations.vllm.transfer import Capture, PagedLayers, Restore, encode_and_store  # noqa: E402

NAMER = EntryNamer("smollm2", "byteplane|zstd:1", "torch.bfloat16", block_size=4)
HASHES = [bytes([i]) * 32 for i in range(10)]


def stored_keys(namer, spans):
    return {key for start, n in spans for key in namer.keys(namer.entry_id(HASHES[start + n - 1], n))}


def lookup(present, namer=NAMER, usable=10, per_entry=2, hashes=HASHES):
    """``present``: stored keys (a dict: key -> tokens it holds, checked against its entry's blocks)."""
    held = (lambda keys: [present[k] for k in keys]) if isinstance(present, dict) else None
    return find_stored_prefix(hashes, usable, per_entry, namer, lambda keys: [k in present for k in keys], held)


def test_importing_the_plugin_imports_neither_vllm_nor_torch():
    code = "import sys, kvtool, kvtool.integrations.vllm; print('vllm' in sys.modules, 'torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == ["False", "False"]


def test_lookup_finds_the_longest_run_of_entries_and_a_short_last_entry():
    present = stored_keys(NAMER, [(0, 2), (2, 2), (4, 1)])
    spans = lookup(present)
    assert [(s.start, s.num_blocks) for s in spans] == [(0, 2), (2, 2), (4, 1)]
    assert [(s.start, s.num_blocks) for s in lookup(stored_keys(NAMER, [(2, 2)]))] == []  # no first entry, no hit


def test_lookup_never_claims_an_entry_holding_other_than_its_tokens():
    spans = [(0, 2), (2, 2), (4, 2)]
    keys = [NAMER.key(NAMER.entry_id(HASHES[start + n - 1], n), 0) for start, n in spans]
    held = {keys[0]: 8, keys[1]: 7, keys[2]: 8}  # the second entry's metadata says 7 tokens, not 2 blocks of 4
    assert spans_end(lookup(held)) == 2


def test_a_store_entry_is_usable_only_with_the_tokens_its_span_holds():
    spans = [(0, 2), (2, 2)]
    keys = [NAMER.key(NAMER.entry_id(HASHES[start + n - 1], n), 0) for start, n in spans]
    with open_store("memory://") as store:
        store.put(keys[0], b"kv", {"tokens": 8})
        store.put(keys[1], b"kv", {"tokens": 5})
        assert tokens_in(store)([keys[0], keys[1], "absent"]) == [8, 5, None]
        assert spans_end(find_stored_prefix(HASHES, 10, 2, NAMER, store.contains_many, tokens_in(store))) == 2


def test_lookup_stays_within_the_usable_blocks():
    present = stored_keys(NAMER, [(0, 2), (2, 2), (4, 2)])
    assert spans_end(lookup(present, usable=5)) == 4


def spans_end(spans):
    return spans[-1].end if spans else 0


def test_other_salt_model_or_recipe_never_hits():
    present = stored_keys(NAMER, [(0, 2), (2, 2)])
    salted = [bytes([i + 100]) * 32 for i in range(10)]  # vLLM folds cache_salt into the block hashes
    assert lookup(present, hashes=salted) == []
    assert lookup(present, namer=EntryNamer("other-model", NAMER.recipe, NAMER.kv_dtype, 4)) == []
    assert lookup(present, namer=EntryNamer(NAMER.model_id, "zstd:3", NAMER.kv_dtype, 4)) == []


def test_every_tensor_parallel_rank_must_hold_an_entry():
    namer = EntryNamer("m", "zstd:1", "bf16", 4, tp_size=2)
    entry = namer.entry_id(HASHES[1], 2)
    assert lookup({namer.key(entry, 0)}, namer=namer) == []
    assert spans_end(lookup({namer.key(entry, 0), namer.key(entry, 1)}, namer=namer)) == 2


def test_saves_wait_for_whole_entries_and_store_a_short_last_one_at_the_end_of_the_prompt():
    assert [(s.start, s.num_blocks) for s in entries_to_save(HASHES, 5, 3, 0, 2, NAMER)] == [(0, 2)]
    assert [(s.start, s.num_blocks) for s in entries_to_save(HASHES, 5, 5, 2, 2, NAMER)] == [(2, 2), (4, 1)]
    assert entries_to_save(HASHES, 5, 9, 5, 2, NAMER) == []  # generated tokens are not stored


def test_load_jobs_skip_what_vllm_has_and_stop_at_the_limit():
    spans = lookup(stored_keys(NAMER, [(0, 2), (2, 2), (4, 2)]))
    jobs = load_jobs(spans, local_blocks=1, block_ids=list(range(100, 110)), limit_blocks=5)
    assert [(j.first_block, j.block_ids) for j in jobs] == [(1, ([101],)), (0, ([102, 103],)), (0, ([104],))]
    groups = (list(range(100, 110)), [-1, -1, -1, 203, 204, 205])  # a sliding-window group keeps the last blocks
    jobs = load_jobs(spans, local_blocks=1, block_ids=groups, limit_blocks=5)
    assert [j.block_ids for j in jobs] == [([101], [-1]), ([102, 103], [-1, 203]), ([104], [204])]
    assert [j.written_blocks() for j in jobs] == [{101}, {102, 103, 203}, {104, 204}]


def test_settings_reject_unknown_options_and_bad_recipes():
    assert ConnectorSettings.from_extra_config({"chunk_tokens": 512}).blocks_per_entry(128) == 4
    with pytest.raises(UsageError, match="unknown"):
        ConnectorSettings.from_extra_config({"stor": "memory://"})
    with pytest.raises(UsageError):
        ConnectorSettings.from_extra_config({"recipe": "no-such-codec"})


def cpu_paged(blocks=6, heads=3, block=4, dim=8):
    """A paged cache in vLLM 0.32's CPU layout, [blocks, heads, block, 2 * dim], with distinct values."""
    return torch.arange(blocks * heads * block * 2 * dim, dtype=torch.float32).reshape(blocks, heads, block, 2 * dim).to(torch.bfloat16)


def test_cpu_layout_puts_key_rows_before_value_rows():
    layer = cpu_paged()
    k, v = kv_views(layer, "CPU_ATTN", head_dim=8, block_size=4)
    rows = layer.view(6, 3, 8, 8)
    assert torch.equal(k[2, 1, 3], rows[2, 1, 3]) and torch.equal(v[2, 1, 3], rows[2, 1, 7])


def test_cuda_layout_splits_the_last_axis():
    layer = cpu_paged()
    k, v = kv_views(layer, "FLASH_ATTN", head_dim=8, block_size=4)
    assert torch.equal(k[1, 2, 0], layer[1, 2, 0, :8]) and torch.equal(v[1, 2, 0], layer[1, 2, 0, 8:])


def test_unknown_layouts_are_refused():
    with pytest.raises(UsageError, match="unsupported paged KV layout"):
        kv_views(torch.zeros(6, 4, 3, 8), "CPU_ATTN", head_dim=8, block_size=4)


def test_gather_then_scatter_moves_blocks_bit_exactly():
    source = cpu_paged()
    target = torch.zeros_like(source)
    for s, t in zip(kv_views(source, "CPU_ATTN", 8, 4), kv_views(target, "CPU_ATTN", 8, 4)):
        array = gather_blocks(s, [4, 1])
        assert array.shape == (3, 8, 8)
        scatter_blocks(t, [0, 5], torch.from_numpy(array.view("<i2")).view(torch.bfloat16))
    assert torch.equal(target[0], source[4]) and torch.equal(target[5], source[1])
    assert not target[1:5].any()


def layers_of(tensors):
    views = [kv_views(t, "CPU_ATTN", 8, 4) for t in tensors]
    return PagedLayers([f"layer.{i}" for i in range(len(tensors))], [k for k, _ in views], [v for _, v in views], 4, torch.bfloat16)


def save_entry(store, source, block_ids, entry_id="e1", recipe="byteplane|zstd:1", first_token=0):
    capture = Capture({"req": [SaveJob(entry_id, block_ids, first_token)]}, num_layers=len(source.names))
    for i in range(len(source.names)):
        capture.take_layer(i, source)
    (entry, first, keys, values), = capture.complete_entries(set())
    assert encode_and_store(store, f"key/{entry}", keys, values, recipe, ModelFacts("m"), first)


def test_an_entry_past_the_prompts_start_records_its_position_and_restores():
    """A stage that codes by position (pca de-rotates keys) needs the entry's place in the prompt."""
    source = layers_of([cpu_paged() + i for i in range(3)])
    target_tensors = [torch.zeros(6, 3, 4, 16, dtype=torch.bfloat16) for _ in range(3)]
    with open_store("memory://") as store:
        save_entry(store, source, [2, 3], first_token=8)
        with KvzReader.from_bytes(store.get("key/e1")) as reader:
            assert reader.token_start == 8
        restore = Restore(store, lambda e: f"key/{e}", layers_of(target_tensors), {"req": [LoadJob("e1", 2, 0, [4, 0])]})
        restore.start(False)
        for i in range(3):
            restore.copy_layer(i)
        assert restore.finish() == set()
    for i in range(3):
        assert torch.equal(target_tensors[i][4], (cpu_paged() + i)[2]) and torch.equal(target_tensors[i][0], (cpu_paged() + i)[3])


@pytest.mark.parametrize("background", [True, False])
def test_restore_writes_every_layer_of_the_saved_blocks(background):
    source = layers_of([cpu_paged() + i for i in range(3)])
    target_tensors = [torch.zeros(6, 3, 4, 16, dtype=torch.bfloat16) for _ in range(3)]
    target = layers_of(target_tensors)
    stats = StatsCollector()
    with open_store("memory://") as store:
        save_entry(store, source, [2, 3])
        restore = Restore(store, lambda e: f"key/{e}", target, {"req": [LoadJob("e1", 2, 0, [4, 0])]}, stats)
        restore.start(background)
        for i in range(3):
            restore.copy_layer(i)
        assert restore.finish() == set()
    for i in range(3):
        assert torch.equal(target_tensors[i][4], (cpu_paged() + i)[2])
        assert torch.equal(target_tensors[i][0], (cpu_paged() + i)[3])
    data = stats.take()
    assert data["counts"] == {"tokens_restored": 8, "entries_restored": 1}
    assert sorted(data["samples"]) == ["restore_copy_seconds", "restore_decode_seconds", "restore_fetch_seconds",
                                       "restore_seconds"]
    times = restore.times
    assert times.total >= times.fetch + times.decode > 0 and times.copy > 0


@pytest.mark.parametrize("background", [True, False])
def test_restore_skips_the_blocks_vllm_already_has(background):
    source = layers_of([cpu_paged() + i for i in range(2)])
    target_tensors = [torch.zeros(6, 3, 4, 16, dtype=torch.bfloat16) for _ in range(2)]
    with open_store("memory://") as store:
        save_entry(store, source, [2, 3])
        restore = Restore(store, lambda e: f"key/{e}", layers_of(target_tensors), {"req": [LoadJob("e1", 2, 1, [5])]})
        restore.start(background)
        assert restore.finish() == set()
    for i in range(2):
        assert torch.equal(target_tensors[i][5], (cpu_paged() + i)[3])
        assert not target_tensors[i][:5].any()


def test_entries_coded_with_a_dictionary_restore_into_paged_blocks_or_fail_cleanly(samples, monkeypatch, tmp_path):
    from kvtool.cache import KVCache
    from kvtool.kvz.header import _facts as header_facts
    from kvtool.modeldict import registry
    from kvtool.modeldict.train import train

    dictionary = train([KVCache.load(samples[0], layers=[0, 1])], classes=2)
    registry.register(dictionary)
    source = layers_of([cpu_paged() + i for i in range(2)])
    target_tensors = [torch.zeros(6, 3, 4, 16, dtype=torch.bfloat16) for _ in range(2)]
    jobs = {"req": [LoadJob("e1", 2, 0, [4, 0])]}
    with open_store("memory://") as store:
        save_entry(store, source, [2, 3], recipe=f"ctxans:{dictionary.id}")
        restore = Restore(store, lambda e: f"key/{e}", layers_of(target_tensors), jobs)
        restore.start(background=False)
        assert restore.finish() == set()
        for i in range(2):
            assert torch.equal(target_tensors[i][4], (cpu_paged() + i)[2])
            assert torch.equal(target_tensors[i][0], (cpu_paged() + i)[3])
        monkeypatch.setattr(registry, "_known", {})  # a reader that has never seen the dictionary
        monkeypatch.setattr(registry, "_files", {})
        header_facts.cache_clear()  # nor a header that names it
        monkeypatch.setenv(registry.PATH_VARIABLE, str(tmp_path))
        stats = StatsCollector()
        missing = Restore(store, lambda e: f"key/{e}", layers_of([torch.zeros(6, 3, 4, 16, dtype=torch.bfloat16)] * 2), jobs, stats)
        missing.start(background=False)
        assert missing.finish() == {4, 0}
    assert stats.take()["counts"]["restore_failures|decode_error"] == 1


def test_a_damaged_or_missing_entry_is_reported_and_later_entries_are_not_used():
    source = layers_of([cpu_paged()])
    target_tensors = [torch.zeros(6, 3, 4, 16, dtype=torch.bfloat16)]
    with open_store("memory://") as store:
        save_entry(store, source, [0], "e1")
        save_entry(store, source, [1], "e2")
        record = bytearray(store.read_record("key/e1"))
        record[-50] ^= 0xFF
        store.write_record("key/e1", bytes(record))
        jobs = [LoadJob("e1", 1, 0, [3]), LoadJob("e2", 1, 0, [4]), LoadJob("e3", 1, 0, [5])]
        stats = StatsCollector()
        restore = Restore(store, lambda e: f"key/{e}", layers_of(target_tensors), {"req": jobs}, stats)
        restore.start(background=True)
        assert restore.finish() == {3, 4, 5}
        assert restore.failed_requests() == {"req"}
        missing = Restore(store, lambda e: f"key/{e}", layers_of(target_tensors), {"other": jobs[2:]}, stats)
        missing.start(background=False)
        assert missing.finish() == {5}
    assert not target_tensors[0].any()
    counts = stats.take()["counts"]
    assert counts == {"restore_failures|damaged": 1, "restore_failures|missing": 1, "tokens_failed": 16}


def test_stats_report_each_tier_and_add_up(tmp_path):
    stats = StatsCollector()
    with open_store(f"memory://?capacity=1MiB,file://{tmp_path}", write_behind=4) as store:
        store.put("a", b"x" * 1000)
        store.flush()
        stats.sample_store(store)
        store.get("a")
        stats.count("lookups", 2)
        stats.observe("restore_fetch_seconds", 0.004)
        first = stats.take()
        stats.sample_store(store)  # only what happened since the last sample counts again
        second = stats.take()
    assert first["counts"]["store_written_bytes|memory"] == first["counts"]["store_written_bytes|file"] > 1000
    assert first["gauges"]["store_entries|file"] == 1 and first["gauges"]["write_behind_queued"] == 0
    assert "store_read_bytes|memory" not in first["counts"] and second["counts"]["store_read_bytes|memory"] > 1000
    assert stats.take() is None
    total = merge(merge({"counts": {}, "samples": {}, "gauges": {}}, first), first)
    line = summary(total)
    assert (line["lookups"], line["fetch_ms_per_step"], line["restore_failures"]) == (4, 4.0, 0)
