#!/usr/bin/env bash
# Runs examples/shared_prefix against Redis servers of its own: first one
# server on a unix socket, then a Redis Cluster of 3 masters on free
# loopback ports (made with `redis-cli --cluster create`). Every server it
# started is stopped by its process id when it ends, however it ends.
#
#   shared_prefix.sh PROGRAM [ARGS...]     (ARGS go to each run of PROGRAM)
#
# Needs redis-server and redis-cli (Debian: redis-server, redis-tools).
set -euo pipefail
program=$1
shift
for tool in redis-server redis-cli python3; do
  command -v "$tool" >/dev/null || { echo "shared_prefix.sh: $tool is not on PATH" >&2; exit 1; }
done

dir=$(mktemp -d)
pids=()
stop_all() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap stop_all EXIT

# start LOG ARGS...: a server without persistence, in the background.
start() {
  local log=$1
  shift
  redis-server "$@" --save '' --appendonly no --loglevel warning >"$log" 2>&1 &
  pids+=($!)
}
# until_true COMMAND...: COMMAND, retried until it succeeds (30 s at most:
# a server starting on a loaded 2-core machine once took over 10 s).
until_true() {
  for _ in $(seq 300); do
    "$@" && return 0
    sleep 0.1
  done
  echo "shared_prefix.sh: gave up waiting for: $*" >&2
  tail -n 20 "$dir"/*/log 2>/dev/null >&2 || true
  return 1
}
answers() { [ "$(redis-cli "$@" ping 2>/dev/null)" = PONG ]; }
cluster_ok() {
  local port
  for port in "${ports[@]}"; do
    redis-cli -p "$port" cluster info 2>/dev/null | grep -q '^cluster_state:ok' || return 1
  done
}

echo "== one Redis server on a unix socket"
mkdir "$dir/single"
start "$dir/single/log" --port 0 --unixsocket "$dir/single/redis.sock" --dir "$dir/single"
until_true answers -s "$dir/single/redis.sock"
"$program" --redis "unix:$dir/single/redis.sock" "$@"

echo "== a Redis Cluster of 3 masters"
# Free ports whose cluster bus ports (port + 10000) are free too.
read -r -a ports < <(python3 - <<'PY'
import socket
ports = []
while len(ports) < 3:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    if port + 10000 > 65535 or port in ports:
        continue
    bus = socket.socket()
    try:
        bus.bind(("127.0.0.1", port + 10000))
    except OSError:
        continue
    finally:
        bus.close()
    ports.append(port)
print(*ports)
PY
)
seeds=()
for port in "${ports[@]}"; do
  mkdir "$dir/$port"
  start "$dir/$port/log" --port "$port" --bind 127.0.0.1 --cluster-enabled yes \
    --cluster-config-file "$dir/$port/nodes.conf" --dir "$dir/$port"
  seeds+=("127.0.0.1:$port")
done
for port in "${ports[@]}"; do until_true answers -p "$port"; done
redis-cli --cluster create "${seeds[@]}" --cluster-replicas 0 --cluster-yes >"$dir/create.log"
until_true cluster_ok
"$program" --cluster --redis "${seeds[0]}" --redis "${seeds[1]}" "$@"
