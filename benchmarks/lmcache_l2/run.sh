#!/usr/bin/env bash
# LMCache with kvtool's L2 adapter against LMCache with its own fs adapter: the table in BENCHMARKS.md
# ("kvtool as LMCache's L2").
#   bash benchmarks/lmcache_l2/run.sh [bench.py options...]      (about 20 minutes on 2 cores)
# Builds what is missing: .venv-lmcache (benchmarks/vs_lmcache/lmcache-env.sh), out/smollm2-135m
# (kvtool convert-model). LMCACHE_PY points at another environment. Writes
# benchmarks/results/lmcache_l2.{json,md}; servers' logs go to a temporary folder named on stderr.
set -euo pipefail
cd "$(dirname "$0")/../.."
LMCACHE_PY=${LMCACHE_PY:-.venv-lmcache/bin/python}
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

[ -x "$LMCACHE_PY" ] || bash benchmarks/vs_lmcache/lmcache-env.sh
[ -f out/smollm2-135m/config.json ] || "$LMCACHE_PY" -m kvtool convert-model out/smollm2-135m
mkdir -p "$OUT"
"$LMCACHE_PY" benchmarks/lmcache_l2/bench.py --python "$LMCACHE_PY" --out "$OUT/lmcache_l2.json" "$@"
"$LMCACHE_PY" benchmarks/lmcache_l2/report.py "$OUT/lmcache_l2.json" | tee "$OUT/lmcache_l2.md"
