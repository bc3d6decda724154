#!/usr/bin/env bash
# The native core's figures in BENCHMARKS.md: the default recipe (exphuff) against the previous
# default and the peers (memcpy, lz4 frame, zstd:3 frame, Blosc2, ZipNN) on the same 256-token
# blocks, for bf16, fp16 and fp8 caches; ctxtans and ctxans beside them, each cache coded with
# the dictionary of the other text, and their kernels alone decoding into buffers allocated
# once; then kvtool.load against safetensors' own loader.
#   bash benchmarks/native_core.sh [OUT_DIR]     (default: out/; needs the caches of run_all.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-out}"
k() { python -m kvtool bench compression "$@"; }
k "$out/code-4096.safetensors" "$out/prose-4096.safetensors" -r exphuff -r "channel-major|byteplane|zstd:huff,lo=none" \
    --repeat 9 --json > "$out/native-bf16.json"
k "$out/code-4096-fp16.safetensors" "$out/prose-4096-fp16.safetensors" -r exphuff -r "channel-major|fp16-split|zstd:huff" \
    -r "byteplane|zstd:1" --repeat 5 --json > "$out/native-fp16.json"
k "$out/code-4096-fp8.safetensors" "$out/prose-4096-fp8.safetensors" -r exphuff -r "byteplane|zstd:1" \
    --repeat 5 --json > "$out/native-fp8.json"
for pair in "code prose" "prose code"; do
    set -- $pair  # $1: the cache measured, $2: the text its dictionary is learnt from
    for s in "" -fp16 -fp8; do
        [ -f "$out/$2$s.kvd" ] || python -m kvtool train "$out/$2-4096$s.safetensors" -o "$out/$2$s.kvd"
        k "$out/$1-4096$s.safetensors" -r exphuff -r "ctxtans:$out/$2$s.kvd" -r "ctxans:$out/$2$s.kvd" \
            --repeat 5 --json > "$out/native-ctx-$1$s.json"
        python benchmarks/ctxtans_kernel.py "$out/$1-4096$s.safetensors" "$out/$2$s.kvd" --repeat 5 \
            > "$out/ctx-kernel-$1$s.md"
    done
done
python benchmarks/load_bench.py "$out/code-4096.safetensors" "$out/prose-4096.safetensors" --repeat 9 > "$out/native-load.md"
python benchmarks/tables.py "$out"/native-*.json > "$out/native-tables.md"
echo "tables in $out/native-tables.md and $out/native-load.md"
