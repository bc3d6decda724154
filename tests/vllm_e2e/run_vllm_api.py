"""vLLM (CPU build) with the kvtool connector serving kvtool's API in-process; drive it with the API client.

    KVTOOL_API_TOKEN=... python run_vllm_api.py SPEC.json

SPEC: {"model": DIR, "store_dir": DIR, "socket": PATH, "prompt_file": F, "salt": S}
Runs the prompt once (its KV is saved), then, through the API: looks the prompt
up by its token ids and salt (the other keying fields default to the
connector's), offloads its entries to the file tier, prefetches them back and
pins them; then runs the prompt again. Prints ``RESULT {...}`` with what the
API answered; the connector's log (stderr) says where the second run restored from.
"""

import json
import logging
import sys
import time
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    kvlog = logging.getLogger("kvtool")
    kvlog.addHandler(handler)
    kvlog.setLevel(logging.DEBUG)  # per-request restore lines are DEBUG

    from vllm import LLM, SamplingParams

    from kvtool.server import ApiClient

    llm = LLM(
        model=spec["model"], max_model_len=4096, enforce_eager=True, enable_prefix_caching=False,
        distributed_executor_backend="uni", dtype="bfloat16", seed=0,
        kv_transfer_config={
            "kv_connector": "KvtoolConnector",
            "kv_connector_module_path": "kvtool.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "store": f"memory://?capacity=512MiB,file://{spec['store_dir']}",
                "chunk_tokens": 256,
                "api": {"listen": f"unix://{spec['socket']}"},
            },
        },
    )
    params = SamplingParams(temperature=0, max_tokens=8)
    prompt = {"prompt": Path(spec["prompt_file"]).read_text()[:5000], "cache_salt": spec["salt"]}
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    tokens = list(first.prompt_token_ids)
    result: dict = {"prompt_tokens": len(tokens)}
    with ApiClient(f"unix://{spec['socket']}") as api:
        found, previous = None, -1
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # saves finish on the connector's background thread
            found = api.lookup(tokens, salt=spec["salt"])
            if found["stored_tokens"] == previous:
                break
            previous = found["stored_tokens"]
            time.sleep(1.0)
        result["stored"] = found["tokens_by_tier"]
        result["other_tenant"] = api.lookup(tokens, salt="another-tenant")["stored_tokens"]
        result["offloaded"] = api.offload(found["keys"])["ok"]
        result["after_offload"] = api.lookup(tokens, salt=spec["salt"])["tokens_by_tier"]
        result["prefetched"] = api.prefetch(found["keys"], wait=True)["ok"]
        result["pinned"] = api.pin(found["keys"])["ok"]
        result["after_prefetch"] = api.lookup(tokens, salt=spec["salt"])["tokens_by_tier"]
        result["keys"] = len(found["keys"])
    second = llm.generate([{**prompt, "prompt": prompt["prompt"] + " And so"}], params, use_tqdm=False)[0]
    result["second_prompt_tokens"] = len(second.prompt_token_ids)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
