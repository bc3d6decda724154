#!/usr/bin/env bash
# The figures in BENCHMARKS.md: dump 4096-token caches of the sample texts, then bench them.
#
#   bash benchmarks/run_all.sh [OUT_DIR]     (default: out/, git-ignored)
#
# Needs the model extra for the dumps (pip install -e '.[model,bench]'); a cache already
# in OUT_DIR is reused. Runs one process at a time; about 30 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-out}"
mkdir -p "$out"
kvtool() { python -m kvtool "$@"; }

for dtype in bf16 fp16; do
    suffix=$([ "$dtype" = bf16 ] && echo "" || echo "-fp16")
    for pair in code:functools.py.txt prose:GPL-3.txt; do
        name="${pair%%:*}" text="samples/texts/${pair#*:}"
        cache="$out/$name-4096$suffix.safetensors"
        [ -f "$cache" ] || kvtool dump "$text" --out "$cache" --max-tokens 4096 --dtype "$dtype"
    done
done

# fp8 (e4m3) caches: the bf16 ones cast, as an fp8 KV cache would hold them unscaled.
for name in code prose; do
    [ -f "$out/$name-4096-fp8.safetensors" ] || python - "$out/$name-4096.safetensors" "$out/$name-4096-fp8.safetensors" <<'PY'
import sys
import ml_dtypes
import numpy as np
from kvtool.cache import KVCache
src = KVCache.load(sys.argv[1])
fp8 = lambda arrays: [a.astype(np.float32).astype(ml_dtypes.float8_e4m3fn) for a in arrays]
KVCache(fp8(src.keys), fp8(src.values), src.model, {**src.provenance, "cast": "fp8_e4m3"}).save(sys.argv[2])
PY
done

# The committed samples: the quick set, as `kvtool bench` runs it with no arguments.
kvtool bench --json --plot benchmarks/samples.png > "$out/bench-samples.json"

# 4096-token bf16 caches: the quick set in 256-token chunks (what the store keeps) and in
# one chunk per tensor (a whole-cache .kvz), plus the slow end of the race to the limit.
big=("$out/code-4096.safetensors" "$out/prose-4096.safetensors")
kvtool bench "${big[@]}" --repeat 2 --json --plot benchmarks/bf16-4096.png > "$out/bench-bf16-4096.json"
kvtool bench "${big[@]}" --repeat 2 --chunk-tokens 4096 --json \
    -r "zstd:3 lz4 channel-major|byteplane|zstd:huff,lo=none channel-major|bf16-split|zstd:huff,mant=none" \
    -r "channel-major|bf16-split|zstd:1,mant=none channel-major|bf16-split|zstd:19,mant=none" \
    -r "channel-major|sx-split|rans:192,mant=none" > "$out/bench-bf16-4096-whole.json"

# fp16 caches of the same texts.
kvtool bench "$out/code-4096-fp16.safetensors" "$out/prose-4096-fp16.safetensors" --repeat 2 --chunk-tokens 4096 --json \
    -r "zstd:3 lz4 channel-major|byteplane|zstd:huff,lo=none channel-major|fp16-split|zstd:huff" \
    -r "channel-major|sx-split|rans:192,mant=none" > "$out/bench-fp16-4096.json"

kvtool bench "$out/code-4096-fp8.safetensors" "$out/prose-4096-fp8.safetensors" --repeat 2 --chunk-tokens 4096 --json \
    -r "zstd:3 lz4 byteplane|zstd:1 channel-major|byteplane|zstd:huff" \
    -r "channel-major|sx-split|rans:192,mant=none" > "$out/bench-fp8-4096.json"

# ctxans: dictionaries learnt on one text, used on it, on the other and on a third.
[ -f "$out/psf-4096.safetensors" ] || kvtool dump samples/texts/PSF-LICENSE.txt --out "$out/psf-4096.safetensors" --max-tokens 4096
python benchmarks/ctxans_bench.py "${big[@]}" --repeat 3 --third "$out/psf-4096.safetensors" \
    --json "$out/ctxans-bf16.json" > "$out/ctxans-bf16.md"
python benchmarks/ctxans_bench.py "$out/code-4096-fp16.safetensors" "$out/prose-4096-fp16.safetensors" --repeat 3 \
    --json "$out/ctxans-fp16.json" > "$out/ctxans-fp16.md"

python benchmarks/tables.py "$out"/bench-*.json > "$out/tables.md"
echo "tables in $out/tables.md; plots in benchmarks/"
