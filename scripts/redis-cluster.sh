#!/usr/bin/env bash
# Start or stop a Redis Cluster of 6 redis-server processes on loopback: 3 masters, each
# with one replica, for kvtool's cluster tier (redis+cluster://).
#
#   bash scripts/redis-cluster.sh start DIR [FIRST_PORT|auto]   # prints the store URL
#   bash scripts/redis-cluster.sh stop DIR
#
# The nodes listen on FIRST_PORT..FIRST_PORT+5 (default 7000; `auto` picks six free
# ports; each node also uses its port + 10000 for the cluster bus), keep no data on disk, and write their logs, pid files and
# cluster state into DIR. `start` waits until every node reports cluster_state:ok and
# prints redis+cluster://127.0.0.1:PORT,... (also written to DIR/url). `stop` ends exactly
# the processes named by DIR's pid files.
#
# KVTOOL_CLUSTER_NODE_TIMEOUT (ms, default 2000) is how long a silent master has before
# its replica takes over. cluster-require-full-coverage is off, so while one master is
# down the other masters keep serving their slots.
set -euo pipefail

usage() { echo "usage: $0 start DIR [FIRST_PORT] | stop DIR" >&2; exit 2; }
[ $# -ge 2 ] || usage
action=$1 dir=$2

stop() {
    local pidfile pid
    for pidfile in "$dir"/redis-*.pid; do
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        rm -f "$pidfile"
    done
}

start() {
    local first=${1:-7000} timeout=${KVTOOL_CLUSTER_NODE_TIMEOUT:-2000} port nodes=()
    [ "$first" = auto ] && first=$(free_ports)
    command -v redis-server >/dev/null || { echo "redis-server is not installed (Debian: apt-get install redis-server)" >&2; exit 1; }
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    for port in $(seq "$first" $((first + 5))); do
        rm -f "$dir/nodes-$port.conf"
        redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
            --cluster-enabled yes --cluster-config-file "nodes-$port.conf" \
            --repl-diskless-sync yes --repl-diskless-sync-delay 0 --repl-diskless-load on-empty-db \
            --cluster-node-timeout "$timeout" --cluster-require-full-coverage no \
            --dir "$dir" --logfile "$dir/redis-$port.log" \
            --daemonize yes --pidfile "$dir/redis-$port.pid"
        nodes+=("127.0.0.1:$port")
    done
    for port in $(seq "$first" $((first + 5))); do
        wait_for "redis-cli -p $port ping" PONG "node $port did not start (see $dir/redis-$port.log)"
    done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >"$dir/create.log" 2>&1 \
        || { cat "$dir/create.log" >&2; stop; exit 1; }
    for port in $(seq "$first" $((first + 5))); do
        wait_for "redis-cli -p $port cluster info" cluster_state:ok "the cluster did not reach cluster_state:ok"
    done
    # Each master has its replica in sync before anyone relies on a failover.
    for port in $(seq "$first" $((first + 5))); do
        wait_for "redis-cli -p $port info replication" "connected_slaves:1|master_link_status:up" "replicas did not sync"
    done
    local url
    url="redis+cluster://$(IFS=,; echo "${nodes[*]}")"
    echo "$url" >"$dir/url"
    echo "$url"
}

# The first of six consecutive free loopback ports whose cluster-bus ports are free too.
free_ports() {
    python3 -c '
import random, socket
for _ in range(500):
    first = random.randrange(20000, 45000)
    try:
        for port in [p + bus for p in range(first, first + 6) for bus in (0, 10000)]:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
    except OSError:
        continue
    print(first)
    break
else:
    raise SystemExit("no six free loopback ports")'
}

# wait_for COMMAND PATTERN MESSAGE: run COMMAND until its output matches the extended
# regular expression PATTERN, for up to 30 s; otherwise stop the nodes and fail.
wait_for() {
    local command=$1 pattern=$2 message=$3
    for _ in $(seq 300); do
        $command 2>/dev/null | grep -Eq "$pattern" && return 0
        sleep 0.1
    done
    echo "$message" >&2
    stop
    exit 1
}

case $action in
    start) start "${3:-}" ;;
    stop) stop ;;
    *) usage ;;
esac
