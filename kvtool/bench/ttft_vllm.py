"""The vLLM engine of the TTFT experiment: vLLM (CPU build) with the kvtool connector, in a subprocess.

vLLM lives in its own environment, so each configuration runs this module as a
script under that environment's python (``python -m kvtool.bench.ttft_vllm
SPEC.json``), in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that
memory and file tiers are shared by vLLM's scheduler and worker. vLLM's own
prefix cache is off: every turn starts with no engine-side cache, and a reused
prefix can only come from kvtool. Turn 0's stored prefix is written by an
untimed request for it. TTFT is the wall time of a request for one token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from kvtool.bench.trace import Turn
from kvtool.errors import UnavailableError

_TOKENIZE = (
    "import json, sys; from transformers import AutoTokenizer; "
    "t = AutoTokenizer.from_pretrained(sys.argv[1]); "
    "print(json.dumps(t(sys.stdin.read(), add_special_tokens=False)['input_ids']))"
)


class VLLMEngine:
    name = "vllm"

    def __init__(self, model: str, python: str | Path) -> None:
        self.model = str(Path(model).resolve())
        self.model_id = Path(model).name
        self.python = str(python)
        if not Path(self.python).exists():
            raise UnavailableError(f"no vLLM python at {self.python}: run scripts/vllm-env.sh or pass --vllm-python")

    def tokenize(self, text: str) -> list[int]:
        done = subprocess.run([self.python, "-c", _TOKENIZE, self.model], input=text, capture_output=True, text=True, check=True)
        return json.loads(done.stdout)

    def run_config(self, trace: Sequence[Turn], store: str | None, recipe: str | None, chunk_tokens: int) -> list[dict]:
        """One vLLM process: the turns of ``trace`` with the connector on ``store`` (None: no connector)."""
        spec = {
            "model": self.model, "store": store, "recipe": recipe, "chunk_tokens": chunk_tokens,
            "warm_prefix": trace[0].tokens[: trace[0].cached_tokens],
            "turns": [{"turn": t.index, "tokens": t.tokens} for t in trace],
        }
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")]))
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        try:
            done = subprocess.run([self.python, "-m", "kvtool.bench.ttft_vllm", f.name], capture_output=True, text=True, env=env, check=False)
        finally:
            os.unlink(f.name)
        rows = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or len(rows) != len(trace):
            raise RuntimeError(f"vLLM run failed (exit {done.returncode}): {done.stderr[-3000:]}")
        return rows


def run(engine: VLLMEngine, trace: Sequence[Turn], *, tiers, recipes, redis_url, chunk_tokens, repeats, progress: Callable[[str], None]) -> dict[str, Any]:
    from kvtool.bench import ttft

    notes = []
    if "redis" in tiers and not redis_url:
        tiers = [t for t in tiers if t != "redis"]
        notes.append("redis: not measured (no --redis-url)")
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="kvtool-ttft-") as workdir:
        for repeat in range(repeats):
            progress("vLLM without the connector")
            results.setdefault(ttft.RECOMPUTE, []).extend({**r, "repeat": repeat} for r in engine.run_config(trace, None, None, chunk_tokens))
            for config in ttft.configs(tiers, recipes):
                progress(f"vLLM with the connector on {config.name}")
                url = ttft.store_url(config.tier, Path(workdir) / f"{config.recipe_name}-{repeat}", redis_url)
                if config.tier == "redis":  # keep configurations apart in one server
                    url += ("&" if "?" in url else "?") + f"prefix=ttft-{config.recipe_name}-{repeat}-{time.time_ns()}:"
                rows = engine.run_config(trace, url, config.recipe, chunk_tokens)
                results.setdefault(config.name, []).extend({**r, "repeat": repeat} for r in rows)
    return ttft.summarise(engine.name, engine.model_id, trace, results, notes, chunk_tokens)


def _serve(spec: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams

    options: dict[str, Any] = dict(
        model=spec["model"], max_model_len=8192, enforce_eager=True, enable_prefix_caching=False,
        distributed_executor_backend="uni", dtype="bfloat16", seed=0,
    )
    if spec["store"]:
        options["kv_transfer_config"] = {
            "kv_connector": "KvtoolConnector",
            "kv_connector_module_path": "kvtool.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": spec["store"], "recipe": spec["recipe"], "chunk_tokens": spec["chunk_tokens"]},
        }
    llm = LLM(**options)
    one_token = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([{"prompt_token_ids": list(range(100, 164))}], one_token, use_tqdm=False)  # warm-up
    llm.generate([{"prompt_token_ids": spec["warm_prefix"]}], one_token, use_tqdm=False)  # the earlier session
    for turn in spec["turns"]:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": turn["tokens"]}], one_token, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        row = {"turn": turn["turn"], "tokens": len(turn["tokens"]), "ttft_s": seconds, "first_token": out.outputs[0].token_ids[0]}
        print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    _serve(json.loads(Path(sys.argv[1]).read_text()))
