#!/usr/bin/env bash
# What budget enforcement costs per request: the same gateway with no budget applying, with a
# budget and a rate limit in the in-process store, and with the same in Redis, all measured in the
# same run against the zero-latency simulator (so only the gateway's own work is measured).
#
#   bench/budget-overhead.sh                 # 15 s per measurement
#   DURATION=30s bench/budget-overhead.sh
#
# The cost ledger is off in all three: on this 2-core machine the SQLite ledger saturates near
# 13k rows/s, and any extra work tips it into spooling, which would be measured instead of the
# budgets (bench/proxy-overhead.sh measures the ledger's own cost).
#
# Latency: wrk, closed loop at LAT_CONNS connections (low load, so queueing does not dominate).
# Throughput: wrk at SAT_CONNS connections (saturation). Redis round trips per request are read
# from Redis' own command counters (EVALSHA/EVAL calls) before and after the Redis runs.
# Needs: wrk (apt-get install wrk), redis-server and redis-cli, python3.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-15s}
LAT_CONNS=${LAT_CONNS:-4}
SAT_CONNS=${SAT_CONNS:-32}
P_UP=${P_UP:-19201}
P_OFF=${P_OFF:-19202}
P_MEM=${P_MEM:-19203}
P_REDIS=${P_REDIS:-19204}
P_RDB=${P_RDB:-19205}
P_RPR=${P_RPR:-19206}

command -v wrk >/dev/null || { echo "needs wrk: apt-get install wrk" >&2; exit 1; }
command -v redis-server >/dev/null || { echo "needs redis-server" >&2; exit 1; }

. bench/common.sh

# A private Redis, so its command counters are ours alone.
redis-server --port "$P_RDB" --bind 127.0.0.1 --save '' --appendonly no --dir "$WORK" >"$WORK/redis.log" 2>&1 &
PIDS+=($!)
wait_port "$P_RDB"

"$SIM_BIN/gateway" simulate --profile zero --model sim-small --port "$P_UP" >"$WORK/sim.log" 2>&1 &
PIDS+=($!)
wait_port "$P_UP"

start_gateway off "$P_OFF" "$P_UP" '[budgets]
store = "memory"'
start_gateway memory "$P_MEM" "$P_UP" '[budgets]
store = "memory"'
start_gateway redis "$P_REDIS" "$P_UP" "[budgets]
store = \"redis\"
redis_urls = [\"redis://127.0.0.1:$P_RDB\"]"
# The same without leases: every request reserves in Redis on its own.
start_gateway redis-no-lease "$P_RPR" "$P_UP" "[budgets]
store = \"redis\"
redis_urls = [\"redis://127.0.0.1:$P_RDB\"]
lease_requests = 0"
# A day budget (tokens and USD) and a per-minute rate limit, far above what the run uses, so
# every request does the full reserve + commit and none is refused.
for g in memory:$P_MEM redis:$P_REDIS redis-no-lease:$P_RPR; do
  bench_budgets "http://127.0.0.1:${g#*:}"
done

cat >"$WORK/post.lua" <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("KEY")
wrk.body = '{"model":"fast","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":16}'
done = function(summary, latency, requests)
  io.write(string.format("RESULT %d %.3f %.3f %.3f %d\n", summary.requests,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000,
    summary.duration / 1e6, summary.errors.status + summary.errors.connect + summary.errors.timeout))
end
EOF

evals() { redis-cli -p "$P_RDB" info commandstats | python3 -c '
import sys
n = 0
for line in sys.stdin:
    if line.startswith(("cmdstat_evalsha:", "cmdstat_eval:")):
        n += int(line.split("calls=")[1].split(",")[0])
print(n)'; }

: >"$WORK/results"
for name in off memory redis redis-no-lease; do
  port=$(awk -F'"' '/^listen/ {split($2, a, ":"); print a[2]}' "$WORK/$name.toml")
  url="http://127.0.0.1:$port/v1/chat/completions"
  export KEY=$(cat "$WORK/$name.key")
  wrk -t1 -c8 -d3s -s "$WORK/post.lua" "$url" >/dev/null # warm up
  before=$(evals)
  lat=$(wrk -t1 -c"$LAT_CONNS" -d"$DURATION" -s "$WORK/post.lua" "$url" | grep '^RESULT')
  sat=$(wrk -t2 -c"$SAT_CONNS" -d"$DURATION" -s "$WORK/post.lua" "$url" | grep '^RESULT')
  after=$(evals)
  echo "$name $lat $sat $before $after" >>"$WORK/results"
done

python3 - "$WORK/results" "$LAT_CONNS" "$SAT_CONNS" <<'PY'
import sys
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    name = f[0]
    # RESULT requests p50 p99 seconds errors (latency run), then the saturation run
    lat = dict(n=int(f[2]), p50=float(f[3]), p99=float(f[4]), secs=float(f[5]), err=int(f[6]))
    sat = dict(n=int(f[8]), p50=float(f[9]), p99=float(f[10]), secs=float(f[11]), err=int(f[12]))
    evals = int(f[14]) - int(f[13])
    rows[name] = (lat, sat, evals)
off_lat, off_sat, _ = rows["off"]
off_rps = off_sat["n"] / off_sat["secs"]
print(f"latency at {sys.argv[2]} connections, throughput at {sys.argv[3]} connections")
print(f"{'budgets':<15}{'p50 ms':>9}{'p99 ms':>9}{'+p50 ms':>9}{'+p99 ms':>9}{'req/s':>10}{'vs off':>8}{'errors':>8}{'redis calls/req':>17}")
for name in ["off", "memory", "redis", "redis-no-lease"]:
    lat, sat, evals = rows[name]
    rps = sat["n"] / sat["secs"]
    calls = evals / (lat["n"] + sat["n"]) if name.startswith("redis") else 0.0
    print(f"{name:<15}{lat['p50']:>9.3f}{lat['p99']:>9.3f}{lat['p50'] - off_lat['p50']:>9.3f}"
          f"{lat['p99'] - off_lat['p99']:>9.3f}{rps:>10.0f}{rps / off_rps:>8.1%}{lat['err'] + sat['err']:>8}{calls:>17.2f}")
PY
