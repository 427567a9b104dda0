#!/usr/bin/env bash
# System calls per request, paired: two gateway builds (BIN_A, BIN_B: directories holding
# `gateway` and `gatewayctl`) in front of the minimal upstream, alternating rounds of wrk at
# CONNS connections (default 1). Each round prints the p50 / p99, the gateway's CPU per request
# (/proc/PID/stat) and, counted by `perf stat` on the syscall tracepoints, the write, writev,
# recvfrom, epoll_wait and futex calls per request (and pwrite64 / fdatasync for SQLite).
#
#   BIN_A=/tmp/b/A BIN_B=/tmp/b/B ROUNDS=4 DUR=5 bench/syscalls.sh
#   CFG=sqlite CONNS=4 BIN_A=... BIN_B=... bench/syscalls.sh    # the embedded cost control
#
# CFG: plain (default: ledger, cache and guard off) or sqlite (bench/common.sh's cost_config).
# EV=none skips perf stat (its tracepoints add to the latency). The proxy's minimal system
# calls per request are 2 recvfrom + 2 writev (the client's request and answer, the upstream's)
# and, at one connection, 2 epoll_wait. Needs: wrk, perf, python3.
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN_A:?BIN_A=DIR}
: "${BIN_B:?BIN_B=DIR}"
DUR=${DUR:-5}
ROUNDS=${ROUNDS:-3}
CONNS=${CONNS:-1}
CFG=${CFG:-plain}
EV=${EV:-syscalls:sys_enter_write,syscalls:sys_enter_writev,syscalls:sys_enter_recvfrom,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_futex,syscalls:sys_enter_pwrite64,syscalls:sys_enter_fdatasync}
. bench/common.sh

P_UP=19701
"$(min_upstream)" --port "$P_UP" --threads 1 >"$WORK/up.log" 2>&1 &
PIDS+=($!)
wait_port "$P_UP"
declare -A PID URL
for v in A B; do
  port=$([ "$v" = A ] && echo 19711 || echo 19712)
  bin_var=BIN_$v
  BIN=${!bin_var}
  # A database and spool of its own for each gateway (cost_config names them after CFG).
  cost_config "$CFG" "$port" "$P_UP" 0 x |
    sed "s|$WORK/$CFG.db|$WORK/$v.db|; s|spool-$CFG|spool-$v|" >"$WORK/$v.toml"
  RUST_LOG=warn "$BIN/gateway" serve --config "$WORK/$v.toml" >"$WORK/$v.log" 2>&1 &
  PIDS+=($!)
  PID[$v]=$!
  wait_port "$port"
  bench_key "http://127.0.0.1:$port" >"$WORK/$v.key"
  if [ "$CFG" != plain ]; then bench_budgets "http://127.0.0.1:$port"; fi
  wrk_post "$(cat "$WORK/$v.key")" '{"model":"fast","messages":[{"role":"user","content":"Question {n}: what is the capital of France?"}],"max_tokens":16}' 1000 >"$WORK/$v.lua"
  URL[$v]="http://127.0.0.1:$port/v1/chat/completions"
done

cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
threads=$((CONNS < 2 ? 1 : 2))
for r in $(seq 1 "$ROUNDS"); do
  for v in A B; do
    pid=${PID[$v]}
    wrk -t"$threads" -c"$CONNS" -d1s -s "$WORK/$v.lua" "${URL[$v]}" >/dev/null
    c0=$(cpu "$pid")
    if [ "$EV" != none ]; then
      perf stat -x, -e "$EV" -p "$pid" -o "$WORK/$v.stat" -- sleep "$DUR" >/dev/null 2>&1 &
      stat_pid=$!
    else
      : >"$WORK/$v.stat"
      stat_pid=
    fi
    out=$(wrk -t"$threads" -c"$CONNS" -d"${DUR}s" -s "$WORK/$v.lua" "${URL[$v]}")
    c1=$(cpu "$pid")
    if [ -n "$stat_pid" ]; then wait "$stat_pid" || true; fi
    n=$(echo "$out" | awk '/^WRK/ {print $2}')
    lat=$(echo "$out" | awk '/^LAT/ {print $2, $3}')
    calls=$(awk -F, -v n="$n" '/syscalls/ {k = $3; sub(/.*sys_enter_/, "", k); printf "%s=%.2f ", k, $1 / n}' "$WORK/$v.stat")
    cpu_us=$(python3 -c "print(round(($c1 - $c0) / $(getconf CLK_TCK) * 1e6 / $n, 1))")
    echo "round $r $v: $((n / DUR)) req/s, p50/p99 ms $lat, CPU µs/request $cpu_us; per request: $calls"
  done
done
