#!/usr/bin/env bash
# A retry storm you can reproduce: 50 clients using the official `openai` Python SDK (default
# retries, 2 s timeout) against the gateway while the small tier's two simulated replicas go
# through three phases: one replica answers 503 (3-11 s), both answer 503 (13-21 s), both answer
# after 5 s, later than the clients' timeout (23-33 s). The large tier stays healthy.
# Load amplification = requests that reached any simulator ÷ distinct client requests; also the
# answered share over time, how soon each small replica's breaker opened after a phase began,
# and how soon the answered share was back at 95% after it ended (tests/python/storm.py, which
# the suite's tests/tests/storm.rs runs too, shorter).
# Run twice: the gateway's protections as shipped, then off.
#
#   BIN=/var/tmp/gw-target/debug bench/storm.sh     # or let bench/common.sh build release
#   MAX_RETRIES=5 bench/storm.sh                     # the SDK's max_retries (default 2)
# Needs: python3 with openai (tests/python/requirements.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
DURATION=${DURATION:-36}
CLIENTS=${CLIENTS:-50}
MAX_RETRIES=${MAX_RETRIES:-2}
P_A=19301 P_B=19302 P_L=19303 P_GW=19304

run() {
  local name=$1 extra=$2
  "$SIM_BIN/gateway" simulate --profile zero --model sim-small --port $P_A >"$WORK/a.log" 2>&1 &
  local a=$!
  "$SIM_BIN/gateway" simulate --profile zero --model sim-small --port $P_B >"$WORK/b.log" 2>&1 &
  local b=$!
  "$SIM_BIN/gateway" simulate --profile zero --model sim-large --port $P_L >"$WORK/l.log" 2>&1 &
  local l=$!
  PIDS+=($a $b $l)
  wait_port $P_A; wait_port $P_B; wait_port $P_L
  {
    toml_head $P_GW "$WORK/$name.db"
    cat <<TOML
[tiers.small]
replicas = [{ name = "a", url = "http://127.0.0.1:$P_A/v1", model = "sim-small" },
            { name = "b", url = "http://127.0.0.1:$P_B/v1", model = "sim-small" }]
[tiers.large]
replicas = [{ name = "l", url = "http://127.0.0.1:$P_L/v1", model = "sim-large" }]
[models]
fast = "small"
[ledger]
enabled = false
[cache]
mode = "off"
$extra
TOML
  } >"$WORK/$name.toml"
  RUST_LOG=error "$BIN/gateway" serve --config "$WORK/$name.toml" >"$WORK/$name.log" 2>&1 &
  local gw=$!
  PIDS+=($gw)
  wait_port $P_GW
  local key
  key=$(bench_key "http://127.0.0.1:$P_GW")
  echo "== $name"
  GATEWAY_BASE_URL="http://127.0.0.1:$P_GW/v1" GATEWAY_API_KEY="$key" \
    GATEWAY_ADMIN_URL="http://127.0.0.1:$P_GW/admin/v1" GATEWAY_ADMIN_TOKEN="$ADMIN" \
    SIM_ROOTS="http://127.0.0.1:$P_A http://127.0.0.1:$P_B http://127.0.0.1:$P_L" \
    DURATION="$DURATION" CLIENTS="$CLIENTS" MAX_RETRIES="$MAX_RETRIES" TIMEOUT=2 \
    PHASES='[["replica a 503", 3, 11], ["tier 503", 13, 21], ["tier slow", 23, 33]]' \
    SIM_SCHEDULES="{\"http://127.0.0.1:$P_A\": [\"3s+8s=503\", \"13s+8s=503\", \"23s+10s=slow:5s\"],
                    \"http://127.0.0.1:$P_B\": [\"13s+8s=503\", \"23s+10s=slow:5s\"]}" \
    python3 tests/python/storm.py | sed '$d'
  kill $gw $a $b $l 2>/dev/null || true
  wait $gw $a $b $l 2>/dev/null || true
  sleep 1
}

run protected ""
run unprotected '[upstream]
failure_threshold = 1000000
error_ratio = 1.0
error_ratio_min_requests = 1000000
retry_budget_ratio = 1.0
retry_budget_min = 1000000
throttle_k = 0.0
fallback_max_share = 1.0
[guard]
retry_action = "off"'
