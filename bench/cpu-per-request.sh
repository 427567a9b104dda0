#!/usr/bin/env bash
# CPU time, system calls and context switches per request of the gateway's plain path and of
# nginx, each in front of the minimal upstream under wrk -c64 (perf stat on the proxy's process).
#
#   BIN=/var/tmp/gw-target/release bench/cpu-per-request.sh
#   WORKERS=1 bench/cpu-per-request.sh       # the gateway on one tokio worker thread
#
# Needs: perf (apt-get install linux-perf), nginx, wrk.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-5}
WORKERS=${WORKERS:-2}
P_UP=${P_UP:-19401}
P_GW=${P_GW:-19402}
P_NGINX=${P_NGINX:-19403}

for tool in perf nginx wrk; do
  command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 1; }
done

. bench/common.sh
UPSTREAM=$(min_upstream)

"$UPSTREAM" --port "$P_UP" --threads 1 >/dev/null &
PIDS+=($!)
wait_port "$P_UP"
{ gateway_toml "$P_GW" "$P_UP" "$WORK/gw.db" "enabled = false"
  printf '[cache]\nmode = "off"\n[guard]\nenabled = false\n'; } >"$WORK/gw.toml"
RUST_LOG=warn TOKIO_WORKER_THREADS=$WORKERS "$BIN/gateway" serve --config "$WORK/gw.toml" >"$WORK/gw.log" 2>&1 &
GW=$!
PIDS+=($GW)
wait_port "$P_GW"
KEY=$(bench_key "http://127.0.0.1:$P_GW")

start_nginx "$P_NGINX" "$P_UP"
NGINX_WORKER=$(pgrep -P "$(cat "$WORK/nginx.pid")" | head -1)

body() { echo "{\"model\":\"$1\",\"messages\":[{\"role\":\"user\",\"content\":\"What is the capital of France?\"}],\"max_tokens\":16}"; }
wrk_post "$KEY" "$(body fast)" >"$WORK/gw.lua"
wrk_post none "$(body sim-small)" >"$WORK/nginx.lua"

printf '| process | CPU per request | syscalls per request | context switches per request |\n|---|---|---|---|\n'
for t in "gateway $GW $P_GW gw" "nginx $NGINX_WORKER $P_NGINX nginx"; do
  set -- $t
  url=http://127.0.0.1:$3/v1/chat/completions
  wrk -t2 -c64 -d2s -s "$WORK/$4.lua" "$url" >/dev/null
  perf stat -e raw_syscalls:sys_enter,context-switches,task-clock -p "$2" -o "$WORK/stat.txt" -- sleep "$DURATION" &
  stat=$!
  n=$(wrk -t2 -c64 -d"${DURATION}s" -s "$WORK/$4.lua" "$url" | awk '/^WRK/ {print $2}')
  wait "$stat"
  awk -v n="$n" -v name="$1" '
    /task-clock/ {gsub(",", "", $1); cpu = $1}
    /sys_enter/ {gsub(",", "", $1); sys = $1}
    /context-switches/ {gsub(",", "", $1); cs = $1}
    END {printf "| %s | %.0f µs | %.1f | %.2f |\n", name, cpu * 1000 / n, sys / n, cs / n}' "$WORK/stat.txt"
done
