"""kvtool's tier under vLLM's own offloading, on a family's chunk layout and real KV (``run_matrix.py``'s save phase).

vLLM's CPU build does not run its offloading worker (the GPU <-> CPU copies), so the
served path cannot run here; its scheduler-side classes can. ``build_offloading_config``
reads the family's engine and KV cache groups as vLLM's ``OffloadingConnector`` does,
``TieringOffloadingSpec`` builds its CPU primary tier and kvtool's tier from that, and a
row of each chunk is filled as vLLM's worker would fill it: every layer's page of one
block of the prompt the engine just computed. The chunks are stored, evicted from the
primary tier by storing as many again, promoted back from kvtool's store and compared
byte for byte (``exact``); a layout the tier does not take stops its start with one line
(``refused``).
"""

from __future__ import annotations

import copy
import mmap
import uuid
from typing import Any

import numpy as np

from test_vllm_offload_tier import Engine, offload_key

CHUNKS = 2  # chunks the primary tier holds; as many again evict them


def tier_row(llm: Any, store: str) -> dict:
    """The family's row for kvtool's tier: ``status`` (exact, refused, wrong) and ``reason``."""
    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from kvtool.errors import UsageError

    engine = llm.llm_engine
    kv_cache_config = engine.engine_core.engine_core.scheduler.kv_cache_config  # the in-process engine's
    layers = engine.vllm_config.compilation_config.static_forward_context
    group = kv_cache_config.kv_cache_groups[0]
    per_block = kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks
    row_bytes = -(-per_block // mmap.PAGESIZE) * mmap.PAGESIZE  # vLLM pads each row to a memory page
    tier = {"type": "KvtoolSecondaryTier", "module_path": "kvtool.integrations.vllm_offload", "store": store}
    if type(group.kv_cache_spec).__name__ in ("FullAttentionSpec", "SlidingWindowSpec"):
        tier["head_dim"] = group.kv_cache_spec.head_size  # keys and values coded as such
    vllm_config = copy.copy(engine.vllm_config)
    vllm_config.kv_transfer_config = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", engine_id=f"matrix-{uuid.uuid4().hex[:12]}",
        kv_connector_extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": CHUNKS * row_bytes,
                                   "blocks_per_chunk": 1, "secondary_tiers": [tier]})
    try:
        tier_engine = Engine(OffloadingSpecFactory.create_spec(build_offloading_config(vllm_config, kv_cache_config)))
    except (UsageError, ValueError) as exc:
        return {"status": "refused", "reason": str(exc).strip().splitlines()[0]}
    pages = [layers[name].kv_cache for name in group.layer_names]  # [blocks, ...] per layer, as the engine holds them
    chunks = [np.concatenate([page[block].contiguous().view(torch.uint8).reshape(-1).numpy() for page in pages])
              for block in range(1, 2 * CHUNKS + 1)]  # blocks the prompt just filled
    keys = [offload_key(i) for i in range(2 * CHUNKS)]
    try:
        tier_engine.store(keys[:CHUNKS], chunks[:CHUNKS])
        tier_engine.store(keys[CHUNKS:], chunks[CHUNKS:])  # evicts the first ones from vLLM's CPU tier
        fetched = [tier_engine.fetch(k, c.size) for k, c in zip(keys[:CHUNKS], chunks)]
        same = [found.name == "HIT" and data is not None and np.array_equal(data, c)
                for (found, data), c in zip(fetched, chunks)]
    finally:
        tier_engine.close()
    if not all(same):
        return {"status": "wrong", "reason": f"promoted chunks equal to what was stored: {same}"}
    return {"status": "exact", "reason": f"{CHUNKS} chunks of {chunks[0].size} bytes promoted from kvtool's store bit for bit"}
