#!/usr/bin/env bash
# kvtool where offload is deployed, one cell per command: the tables in BENCHMARKS.md
# ("kvtool where offload is deployed").
#   bash benchmarks/lmcache_l2/run.sh CELL [bench.py options...]
# CELL: warm | cold | capacity | remote (cells.py). cold drops the L2 files' page cache
# (posix_fadvise); remote needs root (ip netns, veth, tc) and redis-server. Builds what is
# missing: .venv-lmcache (benchmarks/vs_lmcache/lmcache-env.sh), out/smollm2-135m (kvtool
# convert-model). LMCACHE_PY points at another environment. Writes
# benchmarks/results/lmcache_l2_CELL.{json,md}; servers' logs go to a temporary folder it names.
set -euo pipefail
cd "$(dirname "$0")/../.."
CELL=${1:?usage: run.sh warm|cold|capacity|remote [bench.py options...]}
shift
LMCACHE_PY=${LMCACHE_PY:-.venv-lmcache/bin/python}
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

[ -x "$LMCACHE_PY" ] || bash benchmarks/vs_lmcache/lmcache-env.sh
[ -f out/smollm2-135m/config.json ] || "$LMCACHE_PY" -m kvtool convert-model out/smollm2-135m
mkdir -p "$OUT"
"$LMCACHE_PY" benchmarks/lmcache_l2/bench.py --cell "$CELL" --python "$LMCACHE_PY" \
  --out "$OUT/lmcache_l2_$CELL.json" "$@"
"$LMCACHE_PY" benchmarks/lmcache_l2/report.py "$OUT/lmcache_l2_$CELL.json" | tee "$OUT/lmcache_l2_$CELL.md"
