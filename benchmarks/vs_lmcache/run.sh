#!/usr/bin/env bash
# kvtool against LMCache on the same vLLM (CPU build), SmolLM2-135M, the same prompts:
# the table and the plot in BENCHMARKS.md ("kvtool vs LMCache on the same vLLM").
#   bash benchmarks/vs_lmcache/run.sh [bench.py options...]      (about 90 minutes on 2 cores)
# Builds what is missing: .venv-vllm (scripts/vllm-env.sh), .venv-lmcache (lmcache-env.sh
# beside this file), out/smollm2-135m (kvtool convert-model). VLLM_PY / LMCACHE_PY point at
# other environments. Writes benchmarks/results/vs_lmcache.{json,md,png}; servers' logs go
# to a temporary folder named on stderr. Every server it starts it stops, also on Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM_PY=${VLLM_PY:-.venv-vllm/bin/python}
LMCACHE_PY=${LMCACHE_PY:-.venv-lmcache/bin/python}
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

[ -x "$VLLM_PY" ] || bash scripts/vllm-env.sh
[ -x "$LMCACHE_PY" ] || bash benchmarks/vs_lmcache/lmcache-env.sh
[ -f out/smollm2-135m/config.json ] || "$VLLM_PY" -m kvtool convert-model out/smollm2-135m
mkdir -p "$OUT"

"$VLLM_PY" benchmarks/vs_lmcache/bench.py --kvtool-python "$VLLM_PY" --lmcache-python "$LMCACHE_PY" \
  --out "$OUT/vs_lmcache.json" "$@"
"$VLLM_PY" benchmarks/vs_lmcache/profile_restore.py --entries 8 --repeat 5 > "$OUT/vs_lmcache_restore_profile.txt"
python benchmarks/vs_lmcache/report.py "$OUT/vs_lmcache.json" --plot "$OUT/vs_lmcache.png" > "$OUT/vs_lmcache.md"
cat "$OUT/vs_lmcache.md" "$OUT/vs_lmcache_restore_profile.txt"
