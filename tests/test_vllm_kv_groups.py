"""The connector with vLLM's KV cache groups: which models it refuses and why, plans per group, restores into groups.

vLLM's objects are faked by attribute (its spec classes by name, as ``kv_groups`` reads them); the restore runs on
fake paged tensors in vLLM's CPU layout.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace as NS

import numpy as np
import pytest

from kvtool.errors import UsageError
from kvtool.integrations.vllm.context import ConnectorContext
from kvtool.entries import recipe_problem
from kvtool.integrations.vllm.kv_groups import SKIPPED, ModelKV
from kvtool.integrations.vllm.plan import LoadJob, SaveJob
from kvtool.integrations.vllm.scheduler import KvtoolScheduler
from kvtool.store import open_store

BLOCK = 4
HASHES = [bytes([i]) * 32 for i in range(5)]  # a 22-token prompt: 5 full blocks


def spec(kind: str, block: int = BLOCK, heads: int = 2, head_size: int = 8, dtype: str = "torch.bfloat16", **more):
    return type(kind, (), {})() if kind == "Unknown" else _spec(kind, block, heads, head_size, dtype, more)


def _spec(kind, block, heads, head_size, dtype, more):
    value = type(kind, (), {})()  # vLLM's spec classes are told apart by their exact names
    vars(value).update(block_size=block, num_kv_heads=heads, head_size=head_size, dtype=dtype, **more)
    return value


def kv_config(*groups) -> NS:
    return NS(kv_cache_groups=[NS(kv_cache_spec=s, layer_names=names) for s, names in groups], hash_block_size=BLOCK)


GEMMA = kv_config((spec("SlidingWindowSpec", sliding_window=8), ["l0"]), (spec("SlidingWindowSpec", sliding_window=8), ["l1"]),
                  (spec("FullAttentionSpec"), ["l2"]))


def vllm_config(cache_dtype: str = "auto", use_mla: bool = False, prefix_caching: bool = True, device: str = "cpu") -> NS:
    return NS(
        cache_config=NS(block_size=BLOCK, cache_dtype=cache_dtype, prefix_caching_hash_algo="sha256_cbor",
                        enable_prefix_caching=prefix_caching),
        model_config=NS(dtype="torch.bfloat16", model="/models/tiny", hf_config=NS(architectures=["Gemma3ForCausalLM"]),
                        use_mla=use_mla, get_num_layers=lambda parallel: 3, get_num_kv_heads=lambda parallel: 2,
                        get_head_size=lambda: 8),
        parallel_config=NS(pipeline_parallel_size=1, tensor_parallel_size=1, distributed_executor_backend="uni"),
        device_config=NS(device_type=device),
    )


def test_groups_are_read_by_kind_and_a_sliding_window_makes_failures_per_request():
    kv = ModelKV.from_vllm(vllm_config(), GEMMA)
    assert [g.kind for g in kv.groups] == ["sliding", "sliding", "full"] and kv.groups[0].window == 8
    assert kv.refusal is None and kv.per_request_failures and kv.dtype == "bf16"
    assert [kv.group_of(layer) for layer in ("l0", "l1", "l2")] == [0, 1, 2]
    assert kv.describe() == "2 sliding + 1 full groups of 4-token blocks, bfloat16"
    single = ModelKV.from_vllm(vllm_config(cache_dtype="fp8"), kv_config((spec("FullAttentionSpec", dtype="torch.uint8"), ["l0"])))
    assert single.refusal is None and not single.per_request_failures and single.dtype == "fp8_e4m3"
    unnamed = ModelKV.from_vllm(vllm_config())  # vLLM handed no KVCacheConfig: one group of every layer
    assert unnamed.refusal is None and unnamed.group_of("any.layer") == 0 and not unnamed.per_request_failures


@pytest.mark.parametrize(("config", "kv_cache_config", "reason"), [
    ({}, kv_config((spec("MambaSpec"), ["l0.linear_attn"]), (spec("FullAttentionSpec"), ["l1"])),
     "1 state layers (Mamba or linear attention, e.g. l0.linear_attn)"),
    ({"use_mla": True, "prefix_caching": False}, kv_config((spec("MLAAttentionSpec", heads=1, head_size=576), ["l0"])),
     "reference CPU backend, which computes no prompt over cached tokens"),
    ({"use_mla": True, "device": "cuda"}, kv_config((spec("MLAAttentionSpec", heads=1, head_size=576), ["l0"])),
     "not MLA's one latent per token"),
    ({}, kv_config((spec("ChunkedLocalAttentionSpec"), ["l0"])), "kinds kvtool does not know (ChunkedLocalAttentionSpec)"),
    ({}, kv_config((spec("FullAttentionSpec"), ["l0"]), (spec("SlidingWindowSpec", block=8), ["l1"])),
     "different block sizes or block hashes (4/8 tokens)"),
    ({}, kv_config((spec("FullAttentionSpec"), ["l0"]), (spec("SlidingWindowSpec", head_size=16), ["l1"])),
     "different KV shapes (2 heads x 8, 2 heads x 16)"),
    ({"cache_dtype": "fp8_per_token_head"}, kv_config((spec("FullAttentionSpec"), ["l0"])), "KV cache dtype 'fp8_per_token_head'"),
    ({"cache_dtype": "fp8"}, kv_config((spec("FullAttentionSpec", dtype="torch.uint8"), ["l0"]), (spec("SlidingWindowSpec"), ["l1"])),
     "differ in dtype (bfloat16, uint8"),
])
def test_what_cannot_be_restored_exactly_is_refused_with_one_line(config, kv_cache_config, reason):
    refusal = ModelKV.from_vllm(vllm_config(**config), kv_cache_config).refusal
    assert refusal is not None and reason in refusal and "\n" not in refusal


def test_a_recipe_that_cannot_keep_the_cache_dtype_stops_startup():
    assert recipe_problem("exphuff", "fp8_e4m3") is None and recipe_problem("byteplane|zstd:1", "fp8_e4m3") is None
    assert recipe_problem("int:8,group=32|zstd:3", "bf16") is None  # a lossy recipe of a dtype it takes
    assert "takes bf16, fp16, fp32" in recipe_problem("int:8,group=32|zstd:3", "fp8_e4m3")
    with pytest.raises(UsageError, match="cannot keep a fp8_e4m3 KV cache"):
        ConnectorContext.from_vllm(vllm_config(cache_dtype="fp8"), {"store": "memory://", "recipe": "mant-round:3|zstd:1"},
                                   kv_config((spec("FullAttentionSpec", dtype="torch.uint8"), ["l0"])))


def scheduler_for(kv_cache_config, **config) -> KvtoolScheduler:
    extra = {"store": "memory://?capacity=1MiB", "chunk_tokens": 2 * BLOCK, "recipe": "zstd:1"}
    return KvtoolScheduler(ConnectorContext.from_vllm(vllm_config(**config), extra, kv_cache_config), vllm_config())


def request(rid: str, hashes: list[bytes] = HASHES) -> NS:
    return NS(request_id=rid, block_hashes=hashes, num_prompt_tokens=22, num_tokens=22)


def step(req_id: str, block_ids: tuple, computed: int, scheduled: int) -> NS:
    cached = NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return NS(scheduled_new_reqs=[NS(req_id=req_id, block_ids=block_ids, num_computed_tokens=computed)],
              num_scheduled_tokens={req_id: scheduled}, scheduled_cached_reqs=cached)


def test_sliding_window_groups_restore_only_kept_blocks_save_none_they_lost_and_fail_per_request():
    half = scheduler_for(kv_config((spec("SlidingWindowSpec", sliding_window=8), ["l0"]), (spec("FullAttentionSpec"), ["l1"])))
    namer = half.context.namer
    first, second, last = (namer.entry_id(HASHES[start + n - 1], n) for start, n in ((0, 2), (2, 2), (4, 1)))
    try:
        assert half.get_num_new_matched_tokens(request("a"), 0) == (0, False)  # an empty store
        plan = half.build_step_plan(step("a", ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]), 0, 22))
        assert plan.saves["a"] == [SaveJob(first, ([1, 2], [7, 8]), 0), SaveJob(second, ([3, 4], [9, 10]), 8),
                                   SaveJob(last, ([5], [11]), 16)]
        for entry_id, tokens in ((first, 8), (second, 8), (last, 4)):
            half.store.put(namer.key(entry_id, 0), b"kv", {"tokens": tokens})
        assert half.get_num_new_matched_tokens(request("b"), 0) == (20, True)  # asynchronous: failures per request
        half.update_state_after_alloc(request("b"), NS(get_block_ids=lambda: ([0, 0, 0, 24, 25, 26], [30, 31, 32, 33, 34, 35])), 20)
        assert half.build_step_plan(step("x", ([1], [2]), 0, 1)).loads == {
            "b": [LoadJob(first, 2, 0, ([SKIPPED, SKIPPED], [30, 31])), LoadJob(second, 2, 0, ([SKIPPED, 24], [32, 33])),
                  LoadJob(last, 1, 0, ([25], [34]))]}
        half.loads_failed({"b"})
        assert half.get_num_new_matched_tokens(request("b"), 0) == (0, False)  # vLLM computes it: never claimed again
        assert half.get_num_new_matched_tokens(request("d"), 0) == (20, True)
        # another prompt, 4 blocks from vLLM's own cache: its sliding-window blocks past the window are the null block
        other = [bytes([100 + i]) * 32 for i in range(5)]
        assert half.get_num_new_matched_tokens(request("c", other), 16) == (0, False)
        saves = half.build_step_plan(step("c", ([0, 0, 0, 40, 41, 42], [50, 51, 52, 53, 54, 55]), 16, 6)).saves
        assert saves == {"c": [SaveJob(namer.entry_id(other[4], 1), ([41], [54]), 16)]}  # the two with a lost block: not saved
    finally:
        half.shutdown()


def test_a_refused_model_is_named_once_and_nothing_is_claimed_or_saved(caplog):
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        half = scheduler_for(kv_config((spec("MambaSpec"), ["l0.mixer"]), (spec("FullAttentionSpec"), ["l1"])))
    try:
        assert [r.getMessage() for r in caplog.records] == [(
            "kvtool restores nothing for this model: 1 state layers (Mamba or linear attention, e.g. l0.mixer) keep a "
            "recurrent state, not KV, which kvtool does not store, and every prefix needs it; vLLM computes every prompt")]
        assert half.build_step_plan(step("a", ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]), 0, 22)).saves == {}
        half.store.put(half.context.namer.key(half.context.namer.entry_id(HASHES[1], 2), 0), b"kv", {"tokens": 8})
        assert half.get_num_new_matched_tokens(request("b"), 0) == (0, False)
    finally:
        half.shutdown()


torch = pytest.importorskip("torch", reason="the paged-tensor helpers need torch (pip install 'kvtool[model]')")

from kvtool.integrations.vllm.paged import grouped_blocks, kv_views, scatter_blocks, typed
from kvtool.integrations.vllm.transfer import Capture, PagedLayers, Restore, encode_and_store
from kvtool.cache import ModelFacts


def paged(offset: int = 0) -> torch.Tensor:
    """[blocks, heads, block, 2 * dim] in vLLM's CPU layout, with distinct values."""
    return (torch.arange(8 * 2 * BLOCK * 16, dtype=torch.float32).reshape(8, 2, BLOCK, 16) + offset).to(torch.bfloat16)


def grouped(tensors: list[torch.Tensor], groups: list[int]) -> PagedLayers:
    views = [kv_views(t, "CPU_ATTN", 8, BLOCK) for t in tensors]
    return PagedLayers([f"l{i}" for i in range(len(tensors))], [k for k, _ in views], [v for _, v in views], BLOCK,
                       tensors[0].dtype, groups)


def test_skipped_blocks_are_left_out_of_every_copy():
    layers = grouped([paged(), paged(1000)], [0, 1])
    block_ids = ([3, 5], [SKIPPED, 6])  # group 1 dropped the first block (outside its window)
    table = grouped_blocks(layers.paged, [0, 0, 1, 1], block_ids, BLOCK, [0, 1, 2, 3]).table
    assert (table[:2] >= 0).all() and (table[2:, :, :BLOCK] == -1).all() and (table[2:, :, BLOCK:] >= 0).all()
    assert np.array_equal(table[:2], layers.blocks(LoadJob("e", 2, 0, [3, 5])).table[:2])
    assert np.array_equal(table[2:, :, BLOCK:], layers.blocks(LoadJob("e", 2, 0, [4, 6])).table[2:, :, BLOCK:])
    target = torch.zeros(8, 2, BLOCK, 16, dtype=torch.bfloat16)
    keys = kv_views(target, "CPU_ATTN", 8, BLOCK)[0]
    scatter_blocks(keys, [SKIPPED, 6], torch.ones(2, 2 * BLOCK, 8, dtype=torch.bfloat16))
    assert keys[6].eq(1).all() and target.sum() == keys[6].numel()  # the second block's rows, nothing else


def test_an_fp8_cache_allocated_as_bytes_is_viewed_as_fp8():
    raw = torch.arange(16, dtype=torch.uint8)
    assert typed(raw, "fp8_e4m3").dtype == torch.float8_e4m3fn and typed(raw, "fp8_e5m2").dtype == torch.float8_e5m2
    assert typed(raw, "fp8_e4m3").view(torch.uint8).equal(raw) and typed(paged(), "bf16").dtype == torch.bfloat16


@pytest.mark.parametrize("background", [True, False])
def test_each_layer_restores_into_its_own_groups_blocks_and_skips_what_vllm_dropped(background):
    source = grouped([paged(i * 1000) for i in range(3)], [0, 0, 1])  # two layers in group 0, one in group 1
    capture = Capture({"r": [SaveJob("e", ([1, 2], [4, 5]))]}, num_layers=3)
    for i in range(3):
        capture.take_layer(i, source)
    (_, _, keys, values), = capture.complete_entries(set())
    target_tensors = [torch.zeros(8, 2, BLOCK, 16, dtype=torch.bfloat16) for _ in range(3)]
    with open_store("memory://") as store:
        assert encode_and_store(store, "key/e", keys, values, "zstd:1", ModelFacts("m"))
        restore = Restore(store, lambda e: f"key/{e}", grouped(target_tensors, [0, 0, 1]),
                          {"r": [LoadJob("e", 2, 0, ([6, 7], [SKIPPED, 3]))]})
        restore.start(background)
        assert restore.finish() == set() and restore.request_ids() == {"r"}
    for i in range(2):  # group 0: both blocks
        assert torch.equal(target_tensors[i][6], paged(i * 1000)[1]) and torch.equal(target_tensors[i][7], paged(i * 1000)[2])
    assert torch.equal(target_tensors[2][3], paged(2000)[5])  # group 1: only the kept block
    assert not target_tensors[2][:3].any() and not target_tensors[2][4:].any()
    assert not np.any([target_tensors[i][[0, 1, 2, 3, 4, 5]].any().item() for i in range(2)])
