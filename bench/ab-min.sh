#!/usr/bin/env bash
# Paired A/B of two gateway binaries, or of one binary configured two ways, in front of the
# minimal upstream (gateway/examples/min_upstream.rs): alternating rounds (A, B, A, B, ...) of
# wrk at saturation, each printing req/s and the gateway process's CPU per request (from
# /proc/PID/stat), then the medians and B as a share of A.
#
#   bench/ab-min.sh BIN_A BIN_B                          # two builds, the plain configuration
#   EXTRA_B=$'[guard]\nenabled = true' bench/ab-min.sh GW GW   # one build: guard off vs on
#   BODY_FILE=agent.json BUDGETS=1 CONNS=16 bench/ab-min.sh GW_A GW_B   # a fixed (large) body
#     (each `{n}` in the file is replaced by a number new with every request)
#
# Both gateways run the whole time (one SQLite store each; ledger `LEDGER`, default off, or
# `LEDGER_A` / `LEDGER_B` for each: the body of its [ledger] section). Each
# gets the TOML of `EXTRA_A` / `EXTRA_B` after its base configuration (default `EXTRA`: cache off,
# guard off). Without BODY_FILE every request is a new question in one of 1,000 sessions per wrk
# thread (x-session-id), so nothing repeats; with it, the file's JSON body is sent as is (its
# `model` must be `fast`, or `auto` with AUTO=1). BUDGETS=1 sets a day budget and rate limits for the tenant, so the
# budget step (and its prompt token count) runs. PIN=1 runs the gateways on CPU 0 and the
# upstream and wrk on CPU 1, so the gateway under test has a core to itself and the others do
# not take turns with it (on a 2-core machine the ratio is then the gateway's own cost, far less
# noisy than sharing both cores). WATCH=PID also reports that process's CPU per request (a Redis
# both gateways share, say: `EXTRA=$'[guard]\nenabled = true\nstore = "redis"\nredis_urls =
# ["redis://127.0.0.1:6379"]' WATCH=$(pidof redis-server)`). Needs: wrk, python3.
set -euo pipefail
cd "$(dirname "$0")/.."

A=$1
B=$2
ROUNDS=${ROUNDS:-4}
DURATION=${DURATION:-8s}
CONNS=${CONNS:-64}
WRK_THREADS=$((CONNS < 2 ? 1 : 2))
EXTRA=${EXTRA:-$'[cache]\nmode = "off"\n[guard]\nenabled = false'}
EXTRA_A=${EXTRA_A:-$EXTRA}
EXTRA_B=${EXTRA_B:-$EXTRA}
LEDGER=${LEDGER:-enabled = false}
P_UP=${P_UP:-19501}
GW_CPU=()
LOAD_CPU=()
if [ "${PIN:-0}" = 1 ]; then
  GW_CPU=(taskset -c 0)
  LOAD_CPU=(taskset -c 1)
fi

command -v wrk >/dev/null || { echo "needs wrk: apt-get install wrk" >&2; exit 1; }
. bench/common.sh

"${LOAD_CPU[@]}" "$(min_upstream)" --port "$P_UP" --threads 1 >"$WORK/up.log" 2>&1 &
PIDS+=($!)
wait_port "$P_UP"

declare -A GW_PID
port=$((P_UP + 10))
for v in A B; do
  port=$((port + 1))
  bin=${!v}
  extra=EXTRA_$v
  ledger=LEDGER_$v
  # Each gateway journals and spools in a directory of its own (the default, ./spool, would be
  # shared by both).
  { gateway_toml "$port" "$P_UP" "$WORK/$v.db" "${!ledger:-$LEDGER}"$'\n'"spool_dir = \"$WORK/spool-$v\""; echo "${!extra}"; } >"$WORK/$v.toml"
  RUST_LOG=warn "${GW_CPU[@]}" "$bin" serve --config "$WORK/$v.toml" >"$WORK/$v.log" 2>&1 &
  GW_PID[$v]=$!
  PIDS+=($!)
  wait_port "$port"
  url="http://127.0.0.1:$port"
  key=$(bench_key "$url")
  if [ "${BUDGETS:-0}" = 1 ]; then
    bench_budgets "$url"
  fi
  if [ -n "${BODY_FILE:-}" ]; then
    cat >"$WORK/$v.lua" <<EOF
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer $key"
wrk.body = io.open("$(realpath "$BODY_FILE")"):read("*a")
-- Each {n} in the file becomes a number new with every request (a body that never repeats).
if string.find(wrk.body, "{n}", 1, true) then
  local n = 0
  setup = function(thread)
    thread:set("tid", math.random(1, 1000000000))
  end
  request = function()
    n = n + 1
    return wrk.format(nil, nil, nil, (string.gsub(wrk.body, "{n}", tostring(tid) .. "-" .. tostring(n))))
  end
end
done = function(summary, latency, requests)
  local errors = summary.errors.status + summary.errors.connect + summary.errors.timeout
  io.write(string.format("WRK %d %.3f %d\\n", summary.requests, summary.duration / 1e6, errors))
end
EOF
  else
    wrk_post "$key" '{"model":"fast","messages":[{"role":"user","content":"Question {n}: what is the capital of France?"}],"max_tokens":16}' 1000 >"$WORK/$v.lua"
  fi
  echo "$url/v1/chat/completions" >"$WORK/$v.url"
done

: >"$WORK/results"
for r in $(seq 1 "$ROUNDS"); do
  for v in A B; do
    url=$(cat "$WORK/$v.url")
    pid=${GW_PID[$v]}
    "${LOAD_CPU[@]}" wrk -t"$WRK_THREADS" -c"$CONNS" -d2s -s "$WORK/$v.lua" "$url" >/dev/null
    before=$(awk '{print $14 + $15}' "/proc/$pid/stat")
    w_before=$(if [ -n "${WATCH:-}" ]; then awk '{print $14 + $15}' "/proc/$WATCH/stat"; else echo 0; fi)
    read -r n secs errors < <("${LOAD_CPU[@]}" wrk -t"$WRK_THREADS" -c"$CONNS" -d"$DURATION" -s "$WORK/$v.lua" "$url" | awk '/^WRK/ {print $2, $3, $4}')
    after=$(awk '{print $14 + $15}' "/proc/$pid/stat")
    w_after=$(if [ -n "${WATCH:-}" ]; then awk '{print $14 + $15}' "/proc/$WATCH/stat"; else echo 0; fi)
    ticks=$(getconf CLK_TCK)
    echo "$r $v $n $secs $errors $((after - before)) $ticks $((w_after - w_before))" | tee -a "$WORK/results" >&2
  done
done

python3 - "$WORK/results" <<'PY'
import statistics, sys
rows = {"A": [], "B": []}
for line in open(sys.argv[1]):
    r, v, n, secs, errors, ticks, hz, watched = line.split()
    n, secs, ticks, hz, watched = int(n), float(secs), int(ticks), int(hz), int(watched)
    rows[v].append((n / secs, ticks / hz * 1e6 / n, int(errors), watched / hz * 1e6 / n))
print("| build | rounds | req/s (median) | CPU µs per request (median) | watched process's CPU µs per request (median) | errors |")
print("|---|---|---|---|---|---|")
med = {}
for v, rs in rows.items():
    med[v] = (statistics.median(x[0] for x in rs), statistics.median(x[1] for x in rs))
    watched = statistics.median(x[3] for x in rs)
    print(f"| {v} | {', '.join(f'{x[0]:,.0f}' for x in rs)} | {med[v][0]:,.0f} | {med[v][1]:.1f} | {watched:.1f} | {sum(x[2] for x in rs)} |")
print(f"B / A: throughput {100 * med['B'][0] / med['A'][0]:.1f}%, CPU per request {100 * med['B'][1] / med['A'][1]:.1f}%")
PY
