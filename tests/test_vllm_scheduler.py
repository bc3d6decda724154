"""The connector's scheduler half and its context, driven with fake vLLM requests and configs (no vLLM, no torch)."""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace as NS

import pytest

from kvtool.cache import ModelFacts
from kvtool.errors import UsageError
from kvtool.integrations.vllm.context import ConnectorContext
from kvtool.integrations.vllm.plan import LoadJob, SaveJob
from kvtool.integrations.vllm.scheduler import KvtoolScheduler
from kvtool.integrations.vllm.settings import ConnectorSettings
from kvtool.recipe import DEFAULT_RECIPE, Recipe
from kvtool.entries.names import EntryNamer

BLOCK = 4
PER_ENTRY = 2
HASHES = [bytes([i]) * 32 for i in range(5)]  # a 22-token prompt: 5 full blocks
PROMPT_TOKENS = 22


def vllm_config(pipeline: int = 1, model: str = "/models/smollm2") -> NS:
    return NS(
        cache_config=NS(block_size=BLOCK, cache_dtype="auto", prefix_caching_hash_algo="sha256_cbor"),
        model_config=NS(
            dtype="torch.bfloat16", model=model, hf_config=NS(architectures=["LlamaForCausalLM"]),
            get_num_layers=lambda parallel: 30, get_num_kv_heads=lambda parallel: 3, get_head_size=lambda: 64,
        ),
        parallel_config=NS(pipeline_parallel_size=pipeline, tensor_parallel_size=1, distributed_executor_backend="uni"),
    )


@pytest.fixture
def scheduler():
    extra = {"store": "memory://?capacity=1MiB", "chunk_tokens": PER_ENTRY * BLOCK, "recipe": "zstd:1"}
    half = KvtoolScheduler(ConnectorContext.from_vllm(vllm_config(), extra), vllm_config())
    yield half
    half.shutdown()


def request(rid: str, hashes=HASHES, tokens: int = PROMPT_TOKENS) -> NS:
    return NS(request_id=rid, block_hashes=hashes, num_prompt_tokens=tokens, num_tokens=tokens)


def no_cached() -> NS:
    return NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])


def step(new=(), scheduled=None, cached=None) -> NS:
    return NS(scheduled_new_reqs=list(new), num_scheduled_tokens=scheduled or {}, scheduled_cached_reqs=cached or no_cached())


def entry_ids(namer: EntryNamer, spans) -> list[str]:
    return [namer.entry_id(HASHES[start + n - 1], n) for start, n in spans]


def test_the_context_reads_vllms_config():
    context = ConnectorContext.from_vllm(vllm_config(), {"chunk_tokens": 10, "store": "memory://"})
    assert context.namer == EntryNamer("/models/smollm2", Recipe.parse(DEFAULT_RECIPE).spec(), "torch.bfloat16", BLOCK, 1)
    assert context.blocks_per_entry == 2
    assert context.facts == ModelFacts("/models/smollm2", "LlamaForCausalLM", 30, 3, 64, True)
    assert context.settings == ConnectorSettings(store="memory://", chunk_tokens=10)
    with pytest.raises(UsageError, match="pipeline parallelism"):
        ConnectorContext.from_vllm(vllm_config(pipeline=2), {})
    with pytest.raises(UsageError, match="unknown kvtool connector options"):
        ConnectorContext.from_vllm(vllm_config(), {"chunk": 8})


def test_the_scheduler_half_imports_neither_vllm_nor_torch():
    code = "import sys, kvtool.integrations.vllm.scheduler; print('vllm' in sys.modules, 'torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == ["False", "False"]


def test_a_prompt_is_saved_then_found_and_planned_for_restore(scheduler, caplog):
    namer = scheduler.context.namer
    first, second, last = entry_ids(namer, [(0, 2), (2, 2), (4, 1)])
    assert scheduler.get_num_new_matched_tokens(request("a"), 0) == (0, False)  # an empty store
    plan = scheduler.build_step_plan(step([NS(req_id="a", block_ids=([10, 11, 12, 13, 14, 15],), num_computed_tokens=0)],
                                          {"a": PROMPT_TOKENS}))
    assert plan.loads == {}
    assert plan.saves == {"a": [SaveJob(first, [10, 11], 0), SaveJob(second, [12, 13], 8), SaveJob(last, [14], 16)]}
    for entry_id, tokens in ((first, 8), (second, 8), (last, 4)):  # what the worker stores for those jobs
        assert scheduler.store.put(namer.key(entry_id, 0), b"kv", {"tokens": tokens})

    assert scheduler.get_num_new_matched_tokens(request("b"), 0) == (20, False)  # all 5 full blocks
    scheduler.update_state_after_alloc(request("b"), NS(get_block_ids=lambda: ([20, 21, 22, 23, 24, 25],)), 20)
    plan = scheduler.build_step_plan(step([NS(req_id="b", block_ids=([20, 21, 22, 23, 24, 25],), num_computed_tokens=20)],
                                          {"b": 2}))
    assert plan.loads == {"b": [LoadJob(first, 2, 0, [20, 21]), LoadJob(second, 2, 0, [22, 23]), LoadJob(last, 1, 0, [24])]}
    assert all(job.entry_id not in (first, second) for job in plan.saves.get("b", []))  # restored entries stay put

    assert scheduler.get_num_new_matched_tokens(request("c"), 8) == (12, False)  # past vLLM's own 2-block hit
    scheduler.update_state_after_alloc(request("c"), NS(get_block_ids=lambda: ([30, 31, 32, 33, 34, 35],)), 12)
    plan = scheduler.build_step_plan(step())
    assert plan.loads == {"c": [LoadJob(second, 2, 0, [32, 33]), LoadJob(last, 1, 0, [34])]}

    stats = scheduler.take_stats()
    assert stats is not None and stats["counts"] == {"lookups": 3, "lookup_hits": 2, "tokens_found": 32}
    with caplog.at_level(logging.INFO, logger="kvtool.vllm"):
        scheduler.shutdown()
    assert "kvtool at shutdown (scheduler): 3 lookups, 2 hits (32 tokens found), 1 misses" in caplog.text


def test_blocks_that_failed_to_restore_are_saved_again(scheduler):
    namer = scheduler.context.namer
    first, second, last = entry_ids(namer, [(0, 2), (2, 2), (4, 1)])
    for entry_id, tokens in ((first, 8), (second, 8), (last, 4)):
        scheduler.store.put(namer.key(entry_id, 0), b"kv", {"tokens": tokens})
    scheduler.get_num_new_matched_tokens(request("a"), 0)
    blocks = [40, 41, 42, 43, 44, 45]
    scheduler.build_step_plan(step([NS(req_id="a", block_ids=(blocks,), num_computed_tokens=20)], {"a": 2}))
    scheduler.blocks_failed({42})  # the second entry could not be restored: vLLM recomputes from block 2
    cached = NS(req_ids=["a"], new_block_ids=[None], resumed_req_ids=set(), num_computed_tokens=[PROMPT_TOKENS])
    plan = scheduler.build_step_plan(step(scheduled={"a": 1}, cached=cached))
    assert plan.saves == {"a": [SaveJob(second, [42, 43], 8), SaveJob(last, [44], 16)]}
    scheduler.request_finished("a")
    assert not scheduler.build_step_plan(step(scheduled={"a": 1}, cached=cached))  # a finished request plans nothing


def test_hashes_that_do_not_match_the_block_size_are_not_looked_up(scheduler):
    assert scheduler.get_num_new_matched_tokens(request("a", hashes=HASHES[:3]), 0) == (0, False)
    assert scheduler.take_stats() is None  # not even counted as a lookup
