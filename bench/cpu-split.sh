#!/usr/bin/env bash
# Where a configuration's CPU goes, process by process: one gateway configuration of
# bench/proxy-compare.sh (plain, sqlite or pg) in front of the minimal upstream under wrk at
# saturation (every request a new question in one of 1,000 sessions per thread), and each
# process's CPU per request from /proc/PID/stat: the gateway, the upstream, and for pg its Redis
# and every Postgres process (the server is shared, so run it on a quiet Postgres). For pg it
# also prints what Redis counted: `EVALSHA` calls and µs per call, and every command per request
# (those inside scripts included). A second line splits the gateway's CPU per request by its
# threads' names (tokio's workers, SQLite's connection workers, the blocking pool...).
#
#   BIN=DIR CONFIG=pg ROUNDS=2 DURATION=8 bench/cpu-split.sh
#
# Needs: wrk, python3; pg needs Postgres (PGURL, default the test database's server),
# redis-server and redis-cli.
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-pg}
ROUNDS=${ROUNDS:-2}
DURATION=${DURATION:-8}
PGURL=${PGURL:-postgres://postgres@127.0.0.1:5432}
P_UP=${P_UP:-19701}
P_REDIS=${P_REDIS:-19703}
P_GW=${P_GW:-19711}

command -v wrk >/dev/null || { echo "needs wrk: apt-get install wrk" >&2; exit 1; }
. bench/common.sh

"$(min_upstream)" --port "$P_UP" --threads 1 >"$WORK/upstream.log" 2>&1 &
PIDS+=($!)
UP_PID=$!
wait_port "$P_UP"
start_cost_config "$CONFIG" "$P_GW" "$P_UP" "$P_REDIS" "$PGURL"
GW_PID=$(cat "$WORK/gw-$CONFIG.pid")
REDIS_PID=$(cat "$WORK/redis.pid" 2>/dev/null || true)
url="http://127.0.0.1:$P_GW/v1/chat/completions"
wrk_post "$(cat "$WORK/$CONFIG.key")" \
  '{"model":"fast","messages":[{"role":"user","content":"Question {n}: what is the capital of France?"}],"max_tokens":16}' \
  1000 >"$WORK/load.lua"

# ticks PID...: their CPU time together, in clock ticks (0 for none).
ticks() {
  local sum=0 p
  for p in "$@"; do
    sum=$((sum + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)))
  done
  echo "$sum"
}
# threads PID: "name ticks" for each thread of PID, summed by name (digits dropped from it).
threads() {
  local t
  for t in /proc/"$1"/task/*; do
    echo "$(tr -d '0-9' <"$t/comm" | tr ' ' '_') $(awk '{print $14 + $15}' "$t/stat" 2>/dev/null || echo 0)"
  done | awk '{s[$1] += $2} END {for (k in s) print k, s[k]}'
}
postgres_pids() { pgrep -x postgres || true; }
redis_stat() { [ -n "$REDIS_PID" ] && redis-cli -p "$P_REDIS" "$@" || true; }

wrk -t2 -c64 -d2s -s "$WORK/load.lua" "$url" >/dev/null # warm up
HZ=$(getconf CLK_TCK)
for round in $(seq 1 "$ROUNDS"); do
  ledger_drain "$P_GW"
  redis_stat config resetstat >/dev/null
  threads_before=$(threads "$GW_PID")
  before="$(ticks "$GW_PID") $(ticks "$UP_PID") $(ticks $REDIS_PID) $(ticks $(postgres_pids))"
  out=$(wrk -t2 -c64 -d"${DURATION}s" -s "$WORK/load.lua" "$url")
  threads_after=$(threads "$GW_PID")
  after="$(ticks "$GW_PID") $(ticks "$UP_PID") $(ticks $REDIS_PID) $(ticks $(postgres_pids))"
  evalsha=$(redis_stat info commandstats | awk -F'[=,:]' '/^cmdstat_evalsha:/ {print $3, $7}')
  commands=$(redis_stat info stats | awk -F: '/^total_commands_processed:/ {print $2}' | tr -d '\r')
  echo "$out" | awk '/^WRK/ {print $2, $3, $4}' | python3 -c '
import sys
n, secs, errors = sys.stdin.read().split()
n, secs = int(n), float(secs)
config, rnd, hz = sys.argv[1], sys.argv[2], int(sys.argv[3])
before, after = [list(map(int, s.split())) for s in sys.argv[4:6]]
us = [(a - b) * 1e6 / hz / n for a, b in zip(after, before)]
line = (f"{config} round {rnd}: {n / secs:,.0f} req/s, {errors} errors; CPU µs per request: "
        f"gateway {us[0]:.1f}, upstream {us[1]:.1f}")
if config == "pg":
    line += f", redis {us[2]:.1f}, postgres {us[3]:.1f}"
    ev = sys.argv[6].split()
    if len(ev) == 2:
        line += f"; EVALSHA {int(ev[0]) / n:.2f} per request at {float(ev[1]):.1f} µs"
    if sys.argv[7]:
        line += f"; Redis commands per request {int(sys.argv[7]) / n:.1f}"
print(line)
parse = lambda text: {k: int(v) for k, v in (l.split() for l in text.splitlines() if l.strip())}
tb, ta = parse(sys.argv[8]), parse(sys.argv[9])
by = sorted(((ta[k] - tb.get(k, 0)) * 1e6 / hz / n, k) for k in ta)
print("  gateway by thread, CPU µs per request: " +
      ", ".join(f"{k} {v:.1f}" for v, k in reversed(by) if v >= 0.05))' \
    "$CONFIG" "$round" "$HZ" "$before" "$after" "$evalsha" "${commands:-}" "$threads_before" "$threads_after"
done
