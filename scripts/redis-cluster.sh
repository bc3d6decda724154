#!/usr/bin/env bash
# Start or stop a Redis Cluster of 6 redis-server processes on loopback: 3 masters, each
# with one replica, for kvtool's cluster tier (redis+cluster://).
#
#   bash scripts/redis-cluster.sh start DIR [FIRST_PORT|auto]   # prints the store URL
#   bash scripts/redis-cluster.sh stop DIR
#   bash scripts/redis-cluster.sh restart DIR PORT              # one node again, after a crash
#
# The nodes listen on FIRST_PORT..FIRST_PORT+5 (default 7000; `auto` picks six free
# ports; each node also uses its port + 10000 for the cluster bus), keep no data on disk,
# and write their logs, pid files and cluster state into DIR. `start` waits until every
# node reports cluster_state:ok and every replica is in sync, and prints
# redis+cluster://127.0.0.1:PORT,... (also written to DIR/url). `stop` ends exactly the
# processes named by DIR's pid files. `restart` starts one node of DIR's cluster again with
# the cluster state it kept (nodes-PORT.conf) and no data: a killed master comes back as a
# replica of the node that took over, or as an empty master if none did.
#
# KVTOOL_CLUSTER_NODE_TIMEOUT (ms, default 2000) is how long a silent master has before
# its replica takes over. cluster-require-full-coverage is off, so while one master is
# down the other masters keep serving their slots. KVTOOL_CLUSTER_TLS=1 makes a CA and a
# certificate for 127.0.0.1 in DIR (openssl) and runs clients, replication and the cluster
# bus over TLS only; the URL is then rediss+cluster://...?ssl_ca_certs=DIR/ca.crt.
set -euo pipefail

usage() { echo "usage: $0 start DIR [FIRST_PORT|auto] | stop DIR | restart DIR PORT" >&2; exit 2; }
[ $# -ge 2 ] || usage
action=$1 dir=$2
cli=(redis-cli)

stop() {
    local pidfile pids=()
    for pidfile in "$dir"/redis-*.pid; do
        [ -f "$pidfile" ] && pids+=("$(cat "$pidfile")")
    done
    [ ${#pids[@]} -gt 0 ] || return 0
    kill "${pids[@]}" 2>/dev/null || true
    local pid alive
    for _ in $(seq 100); do
        alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    kill -9 "${pids[@]}" 2>/dev/null || true  # any that did not end within 10 s
    rm -f "$dir"/redis-*.pid
}

# The options every node runs with (TLS when KVTOOL_CLUSTER_TLS=1, its files in DIR).
configure() {
    timeout=${KVTOOL_CLUSTER_NODE_TIMEOUT:-2000}
    listen=(--port) scheme=redis query=""
    if [ "${KVTOOL_CLUSTER_TLS:-0}" = 1 ]; then
        listen=(--port 0 --tls-cluster yes --tls-replication yes --tls-auth-clients no
                --tls-cert-file "$dir/node.crt" --tls-key-file "$dir/node.key" --tls-ca-cert-file "$dir/ca.crt" --tls-port)
        cli=(redis-cli --tls --cacert "$dir/ca.crt")
        scheme=rediss query="?ssl_ca_certs=$dir/ca.crt"
    fi
}

# launch PORT: one node, daemonized, its cluster state in DIR/nodes-PORT.conf.
launch() {
    local port=$1
    redis-server "${listen[@]}" "$port" --bind 127.0.0.1 --save '' --appendonly no \
        --cluster-enabled yes --cluster-config-file "nodes-$port.conf" \
        --repl-diskless-sync yes --repl-diskless-sync-delay 0 --repl-diskless-load on-empty-db \
        --cluster-node-timeout "$timeout" --cluster-require-full-coverage no --shutdown-timeout 0 \
        --dir "$dir" --logfile "$dir/redis-$port.log" \
        --daemonize yes --pidfile "$dir/redis-$port.pid"
}

start() {
    local first=${1:-7000} port nodes=()
    [ "$first" = auto ] && first=$(free_ports)
    command -v redis-server >/dev/null || { echo "redis-server is not installed (Debian: apt-get install redis-server)" >&2; exit 1; }
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    [ "${KVTOOL_CLUSTER_TLS:-0}" = 1 ] && make_certificates
    configure
    for port in $(seq "$first" $((first + 5))); do
        rm -f "$dir/nodes-$port.conf"
        launch "$port"
        nodes+=("127.0.0.1:$port")
    done
    for port in $(seq "$first" $((first + 5))); do
        wait_for "${cli[*]} -p $port ping" PONG "node $port did not start (see $dir/redis-$port.log)"
    done
    "${cli[@]}" --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >"$dir/create.log" 2>&1 \
        || { cat "$dir/create.log" >&2; stop; exit 1; }
    for port in $(seq "$first" $((first + 5))); do
        wait_for "${cli[*]} -p $port cluster info" cluster_state:ok "the cluster did not reach cluster_state:ok"
    done
    # Each master has its replica in sync before anyone relies on a failover.
    for port in $(seq "$first" $((first + 5))); do
        wait_for "${cli[*]} -p $port info replication" "connected_slaves:1|master_link_status:up" "replicas did not sync"
    done
    local url
    url="$scheme+cluster://$(IFS=,; echo "${nodes[*]}")$query"
    echo "$url" >"$dir/url"
    echo "$url"
}

restart() {
    local port=${1:?restart needs a port}
    dir=$(cd "$dir" && pwd)
    [ -f "$dir/nodes-$port.conf" ] || { echo "no node $port in $dir" >&2; exit 2; }
    configure
    launch "$port"
    wait_for "${cli[*]} -p $port ping" PONG "node $port did not start (see $dir/redis-$port.log)"
}

# A throwaway CA and a certificate for 127.0.0.1 signed by it, valid for two days.
make_certificates() {
    (
        cd "$dir"
        openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=kvtool test CA" \
            -keyout ca.key -out ca.crt 2>/dev/null
        openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" -keyout node.key -out node.csr 2>/dev/null
        printf 'subjectAltName=IP:127.0.0.1\n' >node.ext
        openssl x509 -req -in node.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
            -extfile node.ext -out node.crt 2>/dev/null
    )
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
    restart) restart "${3:-}" ;;
    *) usage ;;
esac
