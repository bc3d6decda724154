#!/usr/bin/env bash
# TTFT over a multi-turn agent trace: recompute vs restore from each tier and recipe,
# then the plan's predictions checked against the measurements.
#   bash benchmarks/ttft.sh            (HF transformers engine, SmolLM2-135M)
#   ENGINE=vllm bash benchmarks/ttft.sh
# Starts a throwaway loopback redis-server when KVTOOL_REDIS_URL is unset and one is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=${ENGINE:-hf}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
PY=${PYTHON:-python}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout's kvtool

if [[ -z "${KVTOOL_REDIS_URL:-}" ]] && command -v redis-server >/dev/null; then
  port=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  redis_dir=$(mktemp -d)
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$redis_dir" >"$redis_dir/log" 2>&1 &
  redis_pid=$!
  trap 'kill "$redis_pid"; rm -rf "$redis_dir"' EXIT
  sleep 1
  export KVTOOL_REDIS_URL="redis://127.0.0.1:$port/0"
fi

# `kvtool bench ttft` once the command is wired; the function itself otherwise.
if $PY -m kvtool bench ttft --help 2>/dev/null | grep -q -- --max-context; then
  ttft() { $PY -m kvtool bench ttft "$@"; }
else
  ttft() { $PY -c 'import typer; from kvtool.cli.ttft import ttft; typer.run(ttft)' "$@"; }
fi

ttft --engine "$ENGINE" --turns "${TURNS:-3}" --max-context "${MAX_CONTEXT:-2048}" --repeats "${REPEATS:-3}" --hit-rate 0.8 --seed 0 \
  --plot "$OUT/ttft_$ENGINE.png" --json >"$OUT/ttft_$ENGINE.json"
ttft_table() { $PY - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("trace:", r["trace"])
for s in r["summary"]:
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()})
print(*r["not_measured"], sep="\n")
PY
}
ttft_table "$OUT/ttft_$ENGINE.json"
if [[ "$ENGINE" == hf ]]; then
  $PY -m kvtool plan --layers 30 --kv-heads 3 --head-dim 64 --name SmolLM2-135M --chunk-tokens 128 \
    --calibrate "$OUT/ttft_hf.json" --validate "$OUT/ttft_hf.json" --contexts 1024,4096,8192
fi
