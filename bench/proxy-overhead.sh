#!/usr/bin/env bash
# Gateway overhead against calling the upstream directly and against nginx (one plain reverse-proxy
# hop with upstream keep-alive), all measured in the same run on this machine.
#
#   bench/proxy-overhead.sh            # defaults: 1000 req/s for 20 s, then saturation for 15 s
#   RATE=500 DURATION=30s bench/proxy-overhead.sh
#
# Upstream: `gateway simulate --profile zero` (no model latency), so what is measured is the
# proxies' own cost. Load: oha, open loop at RATE with latency correction (no coordinated
# omission), then closed loop at CONNS connections for saturation throughput, measured twice:
# with oha and with wrk. On 2 cores the load generator shares the CPU with the proxy and the
# upstream; oha (Rust, tokio) spends several times more CPU per request than wrk (C), so its
# saturation numbers mostly measure oha. Both are printed.
# Needs: nginx (apt-get install nginx), oha (cargo install oha --locked), wrk (apt-get install
# wrk), python3.
set -euo pipefail
cd "$(dirname "$0")/.."

RATE=${RATE:-1000}
DURATION=${DURATION:-20s}
SAT_DURATION=${SAT_DURATION:-15s}
CONNS=${CONNS:-32}
OPEN_CONNS=${OPEN_CONNS:-64}
P_UP=${P_UP:-19101}
P_NGINX=${P_NGINX:-19102}
P_GW=${P_GW:-19103}
P_GW_NOLEDGER=${P_GW_NOLEDGER:-19104}

command -v nginx >/dev/null || { echo "needs nginx: apt-get install nginx" >&2; exit 1; }
command -v oha >/dev/null || { echo "needs oha: cargo install oha --locked" >&2; exit 1; }
command -v wrk >/dev/null || { echo "needs wrk: apt-get install wrk" >&2; exit 1; }

. bench/common.sh

# Upstream: the zero-latency simulator.
"$SIM_BIN/gateway" simulate --profile zero --model sim-small --port "$P_UP" >"$WORK/sim.log" 2>&1 &
PIDS+=($!)
wait_port "$P_UP"

# nginx: one proxy hop with upstream keep-alive.
start_nginx "$P_NGINX" "$P_UP"

# The gateway: embedded SQLite store, both tiers on the simulator, one worker thread per core.
gateway_toml "$P_GW" "$P_UP" "$WORK/gateway.db" "spool_dir = \"$WORK/spool\"" >"$WORK/gateway.toml"
RUST_LOG=warn "$BIN/gateway" serve --config "$WORK/gateway.toml" >"$WORK/gateway.log" 2>&1 &
GW_PID=$!
PIDS+=($GW_PID)
wait_port "$P_GW"
# The same gateway with the cost ledger off, to measure what the ledger adds.
sed -e "s/127.0.0.1:$P_GW/127.0.0.1:$P_GW_NOLEDGER/" -e 's/^\[ledger\]$/[ledger]\nenabled = false/' \
  "$WORK/gateway.toml" >"$WORK/gateway-noledger.toml"
RUST_LOG=warn "$BIN/gateway" serve --config "$WORK/gateway-noledger.toml" >"$WORK/gateway-noledger.log" 2>&1 &
PIDS+=($!)
wait_port "$P_GW_NOLEDGER"
KEY=$(bench_key "http://127.0.0.1:$P_GW")

rss_kib() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
RSS_IDLE=$(rss_kib "$GW_PID")

BODY_DIRECT='{"model":"sim-small","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":16}'
BODY_GW='{"model":"fast","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":16}'

# run NAME URL BODY EXTRA... -> writes $WORK/NAME.json
run() {
  local name=$1 url=$2 body=$3; shift 3
  oha --no-tui --output-format json -m POST -H "Content-Type: application/json" \
    -H "Authorization: Bearer $KEY" -d "$body" "$@" "$url" >"$WORK/$name.json"
}

# Warm up every path (connections, tokenizer, key snapshot).
for target in "direct http://127.0.0.1:$P_UP/v1/chat/completions $BODY_DIRECT" \
              "nginx http://127.0.0.1:$P_NGINX/v1/chat/completions $BODY_DIRECT" \
              "gateway http://127.0.0.1:$P_GW/v1/chat/completions $BODY_GW" \
              "gateway-noledger http://127.0.0.1:$P_GW_NOLEDGER/v1/chat/completions $BODY_GW"; do
  set -- $target
  run "warm-$1" "$2" "$3" -z 3s -c 16
done

for name in direct nginx gateway gateway-noledger; do
  case $name in
    direct) url=http://127.0.0.1:$P_UP/v1/chat/completions; body=$BODY_DIRECT ;;
    nginx) url=http://127.0.0.1:$P_NGINX/v1/chat/completions; body=$BODY_DIRECT ;;
    gateway) url=http://127.0.0.1:$P_GW/v1/chat/completions; body=$BODY_GW ;;
    gateway-noledger) url=http://127.0.0.1:$P_GW_NOLEDGER/v1/chat/completions; body=$BODY_GW ;;
  esac
  run "open-$name" "$url" "$body" -z "$DURATION" -q "$RATE" --latency-correction -c "$OPEN_CONNS"
  if [ "$name" = gateway ]; then
    ( peak=0; while kill -0 "$GW_PID" 2>/dev/null; do r=$(rss_kib "$GW_PID"); [ "$r" -gt "$peak" ] && peak=$r && echo "$peak" >"$WORK/rss_peak"; sleep 0.2; done ) &
    SAMPLER=$!
  fi
  run "sat-$name" "$url" "$body" -z "$SAT_DURATION" -c "$CONNS"
  [ "$name" = gateway ] && kill "$SAMPLER" 2>/dev/null || true
  wrk_post "$KEY" "$body" >"$WORK/wrk-$name.lua"
  wrk -t2 -c"$CONNS" -d"$SAT_DURATION" -s "$WORK/wrk-$name.lua" "$url" | grep '^WRK' >"$WORK/wrk-$name.txt"
  if [ "$name" = gateway ]; then
    # Let the ledger gateway write its queued rows before the next path is measured (otherwise
    # it keeps a core busy during the no-ledger gateway's phases).
    ledger_drain "$P_GW"
  fi
done
RSS_LOAD=$(cat "$WORK/rss_peak" 2>/dev/null || echo 0)

python3 - "$WORK" "$RATE" "$CONNS" "$RSS_IDLE" "$RSS_LOAD" <<'PY'
import json, sys, os
work, rate, conns, rss_idle, rss_load = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
def load(name):
    with open(os.path.join(work, name + ".json")) as f:
        return json.load(f)
def pct(d, p):
    return d["latencyPercentiles"][p] * 1000.0
def ok(d):
    codes = d.get("statusCodeDistribution", {})
    total = sum(codes.values())
    return codes.get("200", 0), total
rows = []
wrk = {}
for n in ["direct", "nginx", "gateway", "gateway-noledger"]:
    o, s = load("open-" + n), load("sat-" + n)
    rows.append((n, pct(o, "p50"), pct(o, "p99"), o["summary"]["requestsPerSec"], ok(o), s["summary"]["requestsPerSec"], ok(s)))
    with open(os.path.join(work, "wrk-" + n + ".txt")) as f:
        _, reqs, secs, errs = f.read().split()
        wrk[n] = (int(reqs) / float(secs), int(errs))
print(f"\nopen loop at {rate} req/s (latency in ms), then saturation with {conns} connections\n")
print("| path | p50 ms | p99 ms | achieved req/s | 200s/total | saturation req/s (oha) | 200s/total | saturation req/s (wrk) | errors (wrk) |")
print("|---|---|---|---|---|---|---|---|---|")
for n, p50, p99, rps, (o2, ot), sat, (s2, st) in rows:
    print(f"| {n} | {p50:.3f} | {p99:.3f} | {rps:.0f} | {o2}/{ot} | {sat:.0f} | {s2}/{st} | {wrk[n][0]:.0f} | {wrk[n][1]} |")
d, ng, g, gn = rows
print()
print(f"gateway added latency vs direct: p50 {g[1]-d[1]:+.3f} ms, p99 {g[2]-d[2]:+.3f} ms")
print(f"nginx added latency vs direct:   p50 {ng[1]-d[1]:+.3f} ms, p99 {ng[2]-d[2]:+.3f} ms")
print(f"gateway saturation throughput (oha) = {100*g[5]/ng[5]:.0f}% of nginx, {100*g[5]/d[5]:.0f}% of direct")
print(f"gateway saturation throughput (wrk) = {100*wrk['gateway'][0]/wrk['nginx'][0]:.0f}% of nginx, {100*wrk['gateway'][0]/wrk['direct'][0]:.0f}% of direct")
print(f"cost ledger (SQLite) adds vs the same gateway without it: p50 {g[1]-gn[1]:+.3f} ms, p99 {g[2]-gn[2]:+.3f} ms, saturation {100*g[5]/gn[5]:.0f}% of no-ledger")
print(f"gateway resident memory: idle {rss_idle/1024:.1f} MiB, peak under load {rss_load/1024:.1f} MiB")
PY
