#!/usr/bin/env bash
# The installed wheel works on its own: build kvtool's wheel, install it into a fresh
# virtual environment (core dependencies only, from the package index or pip's cache),
# and run the installed `kvtool` from outside the checkout on a real cache:
#   bash scripts/wheel-smoke.sh [CACHE.safetensors]     (default: samples/code.safetensors)
# Fails if the installed package reads anything from the source tree, lacks its license
# or py.typed, or if codecs, compress, decompress (bit-exact), verify or bench fail.
set -euo pipefail
cd "$(dirname "$0")/.."

py=${PYTHON:-python3}
cache=$(realpath "${1:-samples/code.safetensors}")
work=$(mktemp -d /tmp/kvtool-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT
step() { echo "wheel-smoke: $*"; }

step "building the wheel"
"$py" -m pip wheel -q --no-deps -w "$work/dist" .
wheel=$(ls "$work"/dist/kvtool-*.whl)
"$py" - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
missing = [want for want in ("kvtool/py.typed", "/licenses/LICENSE") if not any(n.endswith(want) for n in names)]
assert not missing, f"the wheel lacks {missing}"
EOF

step "installing $(basename "$wheel") into a fresh virtual environment"
"$py" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$wheel"

# From an empty directory, with nothing on PYTHONPATH: only the installed package is importable.
cd "$work"
export -n PYTHONPATH 2>/dev/null || true
unset PYTHONPATH
kvtool=("$work/venv/bin/kvtool")
"$work/venv/bin/python" -c "import kvtool, sys; assert kvtool.__file__.startswith(sys.prefix), kvtool.__file__"
step "$("${kvtool[@]}" --version)"
"${kvtool[@]}" codecs
"${kvtool[@]}" compress "$cache" "$work/cache.kvz"
"${kvtool[@]}" verify "$work/cache.kvz" --full
"${kvtool[@]}" decompress "$work/cache.kvz" "$work/back.safetensors"
"$work/venv/bin/python" - "$cache" "$work/back.safetensors" <<'EOF'
import sys
import kvtool
assert kvtool.KVCache.load(sys.argv[1]).equal_bits(kvtool.KVCache.load(sys.argv[2])), "decompress is not bit-exact"
EOF
"${kvtool[@]}" bench "$cache" --recipes 'exphuff zstd:3' --repeat 1 --no-peers
if "${kvtool[@]}" bench 2>"$work/err"; then
    echo "wheel-smoke: kvtool bench without a FILE found caches outside the package" >&2
    exit 1
fi
grep -q "name the KV caches" "$work/err"
step "passed"
