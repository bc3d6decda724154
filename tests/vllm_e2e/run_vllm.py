"""Run vLLM (CPU build) on a list of prompts, optionally with the kvtool connector; print JSON results.

    python run_vllm.py SPEC.json

SPEC: {"model": DIR, "store": URL or null (no connector), "overlap": true|false|null,
       "recipe": null (the connector's default) or a recipe spec, "dictionary": null or the connector's
       dictionary setting, "prefix_caching": false,
       "max_tokens": 16, "steps": [{"prompt_file": F, "suffix": S, "salt": null, "corrupt_dir": null}]}
Each step's result line is ``RESULT {"tokens": [...], "seconds": ...}`` on stdout
(``vllm_cached_tokens``: the prompt tokens vLLM's own prefix cache supplied).
``corrupt_dir`` flips one byte in every stored entry under it before the step runs;
``after_log`` waits (up to 300 s) until a kvtool log line containing it has been written.
vLLM's own prefix cache is off unless "prefix_caching" is set, so a reused
prefix can only come from kvtool.
Run with VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's CPU build otherwise puts its
scheduler and worker in two processes, which a file store cannot be shared by.
"""

import json
import logging
import sys
import threading
import time
from pathlib import Path


class LogWatch(logging.Handler):
    """Remembers kvtool's log lines, so a step can wait for one (a dictionary learnt in the background)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self.changed:
            self.lines.append(record.getMessage())
            self.changed.notify_all()

    def wait_for(self, text: str, timeout: float = 300) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: any(text in line for line in self.lines), timeout):
                raise SystemExit(f"no kvtool log line with {text!r} after {timeout} s")


def corrupt_entries(root: Path) -> int:
    files = sorted(root.rglob("*.kve"))
    for path in files:
        with open(path, "r+b") as f:
            f.seek(-100, 2)
            byte = f.read(1)
            f.seek(-100, 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    return len(files)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    kvlog = logging.getLogger("kvtool")
    kvlog.addHandler(handler)
    kvlog.setLevel(logging.DEBUG)  # per-request restore lines are DEBUG
    watch = LogWatch()
    kvlog.addHandler(watch)

    from vllm import LLM, SamplingParams

    options = dict(
        model=spec["model"], max_model_len=4096, enforce_eager=True, enable_prefix_caching=bool(spec.get("prefix_caching")),
        distributed_executor_backend="uni", dtype="bfloat16", seed=0,
    )
    if spec.get("store"):
        options["kv_transfer_config"] = {
            "kv_connector": "KvtoolConnector",
            "kv_connector_module_path": "kvtool.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": spec["store"], "overlap": spec.get("overlap"),
                                          **{name: spec[name] for name in ("recipe", "dictionary") if spec.get(name)}},
        }
    llm = LLM(**options)
    params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 16))
    for step in spec["steps"]:
        if step.get("after_log"):
            watch.wait_for(step["after_log"])
        if step.get("corrupt_dir"):
            print(f"corrupted {corrupt_entries(Path(step['corrupt_dir']))} entries", file=sys.stderr, flush=True)
        text = Path(step["prompt_file"]).read_text()[: step.get("prompt_chars", 5000)] + step.get("suffix", "")
        prompt = {"prompt": text, "cache_salt": step["salt"]} if step.get("salt") else {"prompt": text}
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        result = {"tokens": list(out.outputs[0].token_ids), "prompt_tokens": len(out.prompt_token_ids), "seconds": seconds,
                  "vllm_cached_tokens": out.num_cached_tokens}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
