"""One vLLM engine (CPU build) for benchmarks/torture.py, driven over stdin/stdout.

    python benchmarks/torture_engine.py SPEC.json

SPEC: {"model": DIR, "store": URL or null (no connector: vLLM alone), "prefix_caching": bool,
       "block_size": 128, "num_blocks": N or null, "chunk_tokens": 256, "seed": 0,
       "lmcache_port": N or null (LMCache's LMCacheMPConnector to the LMCache server on that port instead
       of kvtool's connector; vLLM then runs its engine core in a process of its own, as served)}
Then one JSON command a line on stdin: {"prompts": [{"text": ... or "token_ids": [...],
"salt": ... or null}], "max_tokens": 8} (or {"reset": true}: empty vLLM's prefix cache),
and one JSON line a command on stdout, prefixed ``RESULT ``:
{"results": [{"tokens": [...], "prompt_token_ids": [...], "logprobs": [{token: logprob} of the
top 5, a generated token each], "restored": n, "failed_entries": n}],
"preemptions": n} (vLLM's count since the engine started).
``restored`` is what kvtool's connector logged for the request ("restored N tokens"), or with
LMCache the prompt tokens vLLM did not compute (its prefix cache is off then: all came from
LMCache); ``failed_entries`` the entries kvtool's connector refused and left to vLLM to recompute. The engine
prints ``READY`` once loaded and runs until stdin closes (or it is killed, which the
torture harness does on purpose).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path

TOP_LOGPROBS = 5  # per generated token: how close vLLM's choice was to the runners-up
RESTORED = re.compile(r"request (\S+): restored (\d+) tokens(?:.*?; (\d+) entries failed)?")


class _Restores(logging.Handler):
    """Collects the connector's per-request restore lines of the current command."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def per_request(self) -> dict[str, tuple[int, int]]:
        found: dict[str, tuple[int, int]] = {}
        for line in self.lines:
            m = RESTORED.search(line)
            if m:
                tokens, failed = found.get(m.group(1), (0, 0))
                found[m.group(1)] = (tokens + int(m.group(2)), failed + int(m.group(3) or 0))
        return found


def _options(spec: dict) -> dict:
    options = dict(
        model=spec["model"], max_model_len=2048, enforce_eager=True, dtype="bfloat16", seed=spec.get("seed", 0),
        distributed_executor_backend="uni", enable_prefix_caching=bool(spec.get("prefix_caching")),
        block_size=spec.get("block_size", 128), disable_log_stats=False,
    )
    if spec.get("num_blocks"):
        options["num_gpu_blocks_override"] = spec["num_blocks"]
    if spec.get("lmcache_port"):
        del options["distributed_executor_backend"]  # LMCache's connector in vLLM's own worker process, as served
        options["kv_transfer_config"] = {
            "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": spec["lmcache_port"],
                                          "lmcache.mp.mp_transfer_mode": "lmcache_driven"},
        }
    elif spec.get("store"):
        options["kv_transfer_config"] = {
            "kv_connector": "KvtoolConnector", "kv_connector_module_path": "kvtool.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": spec["store"], "chunk_tokens": spec.get("chunk_tokens", 256),
                                          "write_behind": 0},
        }
    return options


def _restore_of(request_id: str, found: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """vLLM may suffix the engine's own id of a request; the connector logs that id."""
    tokens = failed = 0
    for rid, (t, f) in found.items():
        if rid == request_id or rid.startswith(request_id + "-"):
            tokens, failed = tokens + t, failed + f
    return tokens, failed


def _preemptions(llm) -> int:
    """vLLM's own count of preempted requests so far (``vllm:num_preemptions``)."""
    return int(sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    restores = _Restores()
    kvlog = logging.getLogger("kvtool")
    kvlog.addHandler(restores)
    kvlog.setLevel(logging.DEBUG)

    protocol = sys.stdout
    sys.stdout = sys.stderr  # vLLM logs to stdout; only the protocol's lines go there
    if spec.get("lmcache_port"):  # LMCache's connector does not load beside the model in one process
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    from vllm import LLM, SamplingParams

    llm = LLM(**_options(spec))
    print("READY", file=protocol, flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("reset"):
            llm.reset_prefix_cache()
            print("RESULT " + json.dumps({"results": [], "preemptions": _preemptions(llm)}), file=protocol, flush=True)
            continue
        params = SamplingParams(temperature=0, max_tokens=command.get("max_tokens", 8), logprobs=TOP_LOGPROBS)
        prompts = [{**({"prompt_token_ids": p["token_ids"]} if "token_ids" in p else {"prompt": p["text"]}),
                    **({"cache_salt": p["salt"]} if p.get("salt") else {})} for p in command["prompts"]]
        restores.lines.clear()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        found = restores.per_request()
        results = []
        for out in outputs:
            restored, failed = _restore_of(out.request_id, found)
            if spec.get("lmcache_port"):
                restored = out.num_cached_tokens or 0
            top = [{str(t): lp.logprob for t, lp in step.items()} for step in (out.outputs[0].logprobs or [])]
            results.append({"tokens": list(out.outputs[0].token_ids), "prompt_token_ids": list(out.prompt_token_ids),
                            "logprobs": top, "restored": restored, "failed_entries": failed})
        print("RESULT " + json.dumps({"results": results, "preemptions": _preemptions(llm)}), file=protocol,
              flush=True)


if __name__ == "__main__":
    main()
