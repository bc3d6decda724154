"""Run the model matrix's families one after another in this process, with kvtool's connector; one JSON line each.

    python run_matrix.py SPEC.json

SPEC: {"phase": "save" or "restore", "models": DIR, "stores": DIR, "families": [NAME, ...]}
(families from ``families.py``, each model folder ``DIR/NAME``, each store ``file://STORES/NAME``).

- save: the prompt P + a suffix is computed (``cold``: kvtool saves P's blocks), asked again
  (``warm``: vLLM's own prefix cache supplies P), then another prefix Q with the same suffix
  (``control``: the prefix's KV changes the output, so an equal output means equal KV); then
  kvtool's tier under vLLM's own offloading takes chunks of the family's layout and KV
  (``tier_rows``);
- restore, in a fresh process: P + suffix under another ``cache_salt`` (``salted``: nothing to
  restore), then P + suffix (``restored``: kvtool restores P), then, with one byte of every
  stored entry flipped and vLLM's own prefix cache emptied, P + suffix again (``damaged``: every
  restore fails its checksum and vLLM computes the prompt).

Greedy decoding; each result holds the tokens and the log-probability of each, vLLM's cached
tokens, and the tokens kvtool restored for that request (its DEBUG line). A family vLLM cannot
build or run is reported with vLLM's error (``error``). The prompt and vLLM's dummy weights are
``families``'s (``dummy_weights_in``). Run with VLLM_ENABLE_V1_MULTIPROCESSING=0 (one process per
engine: several engines one after the other, and kvtool's store shared by scheduler and worker).
"""

import gc
import json
import logging
import re
import sys
import time
from pathlib import Path

from families import DUMMY_RANGE, FAMILIES, MAX_TOKENS, OTHER, PROMPT, SUFFIX, dummy_weights_in, vllm_error
from run_vllm import corrupt_entries
from tier_rows import tier_row

KV_CACHE_BYTES = 64 * 2**20  # a few hundred blocks of a tiny model: the families run one after the other


class KvtoolLines(logging.Handler):
    """kvtool's log lines of the family being run."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def restored_since(self, mark: int) -> int:
        """Tokens kvtool restored since line ``mark`` (one request runs at a time here)."""
        return sum(int(n) for line in self.lines[mark:] for n in re.findall(r"restored (\d+) tokens", line))

    def count_since(self, mark: int, text: str) -> int:
        return sum(text in line for line in self.lines[mark:])

    def first(self, pattern: str) -> str | None:
        return next((m.group(1) for line in self.lines if (m := re.search(pattern, line))), None)


def run_family(family, spec: dict, lines: KvtoolLines) -> dict:
    from vllm import LLM, SamplingParams

    row: dict = {"family": family.name, "phase": spec["phase"]}
    try:
        llm = LLM(
            model=str(Path(spec["models"]) / family.name), load_format="dummy", max_model_len=1024,
            kv_cache_memory_bytes=KV_CACHE_BYTES, enforce_eager=True, enable_prefix_caching=True,
            distributed_executor_backend="uni", dtype="bfloat16", seed=0, kv_transfer_config={
                "kv_connector": "KvtoolConnector", "kv_connector_module_path": "kvtool.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"store": f"file://{Path(spec['stores']) / family.name}"},
            }, **family.engine,
        )
    except Exception as exc:  # noqa: BLE001 - vLLM's reason is the row's result
        return {**row, "error": vllm_error(exc)}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1)
    steps = ({"cold": (PROMPT, None), "warm": (PROMPT, None), "control": (OTHER, None)} if spec["phase"] == "save"
             else {"salted": (PROMPT, "another-tenant"), "restored": (PROMPT, None), "damaged": (PROMPT, None)})
    try:
        for name, (text, salt) in steps.items():
            prompt = {"prompt": text + SUFFIX, **({"cache_salt": salt} if salt else {})}
            if name == "damaged":
                corrupt_entries(Path(spec["stores"]) / family.name)
                llm.reset_prefix_cache()
            mark = len(lines.lines)
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            tokens = list(out.outputs[0].token_ids)
            row[name] = {"tokens": tokens, "logprobs": [lp[t].logprob for t, lp in zip(tokens, out.outputs[0].logprobs)],
                         "prompt_tokens": len(out.prompt_token_ids), "vllm_cached": out.num_cached_tokens,
                         "kvtool_restored": lines.restored_since(mark),
                         "kvtool_failed": lines.count_since(mark, "vLLM will recompute it")}
        if spec["phase"] == "save":
            try:
                row["tier"] = tier_row(llm, f"file://{Path(spec['stores']) / family.name}-tier")
            except Exception as exc:  # noqa: BLE001 - the tier's row, not the family's
                row["tier"] = {"status": "failed", "reason": vllm_error(exc)}
    except Exception as exc:  # noqa: BLE001
        row["error"] = vllm_error(exc)
    finally:
        llm.llm_engine.engine_core.shutdown()  # the worker, its KV cache and kvtool's connector with it
        del llm
    row["refusal"] = lines.first(r"kvtool restores nothing for this model: (.*); vLLM computes")
    row["groups"] = lines.first(r"kvtool: (?:\d+ layers \(|no layer registered \()(.*?)\)")
    return row


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    lines = KvtoolLines()
    kvlog = logging.getLogger("kvtool")
    kvlog.addHandler(lines)
    kvlog.setLevel(logging.DEBUG)  # per-request restore lines are DEBUG
    dummy_weights_in(DUMMY_RANGE)
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    by_name = {f.name: f for f in FAMILIES}
    for name in spec["families"]:
        lines.lines.clear()
        started = time.perf_counter()
        row = run_family(by_name[name], spec, lines)
        gc.collect()
        cleanup_dist_env_and_memory()
        row["seconds"] = round(time.perf_counter() - started, 1)
        print("FAMILY " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
