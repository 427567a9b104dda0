#!/usr/bin/env bash
# A retry storm you can reproduce: 50 clients using the official `openai` Python SDK (default
# retries, 2 s timeout) against the gateway while the small tier's two simulated replicas go
# through three phases: one replica answers 503 (3-11 s), both answer 503 (13-21 s), both answer
# after 5 s, later than the clients' timeout (23-33 s). The large tier stays healthy.
# Load amplification = requests that reached any simulator ÷ distinct client requests.
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
  "$SIM_BIN/gateway" simulate --profile zero --model sim-small --port $P_A \
    --fault 3s+8s=503 --fault 13s+8s=503 --fault 23s+10s=slow:5s >"$WORK/a.log" 2>&1 &
  local a=$!
  "$SIM_BIN/gateway" simulate --profile zero --model sim-small --port $P_B \
    --fault 13s+8s=503 --fault 23s+10s=slow:5s >"$WORK/b.log" 2>&1 &
  local b=$!
  "$SIM_BIN/gateway" simulate --profile zero --model sim-large --port $P_L >"$WORK/l.log" 2>&1 &
  local l=$!
  PIDS+=($a $b $l)
  wait_port $P_A; wait_port $P_B; wait_port $P_L
  cat >"$WORK/$name.toml" <<TOML
[server]
listen = "127.0.0.1:$P_GW"
[store]
url = "sqlite://$WORK/$name.db"
[admin]
token = "$ADMIN"
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
  RUST_LOG=error "$BIN/gateway" serve --config "$WORK/$name.toml" >"$WORK/$name.log" 2>&1 &
  local gw=$!
  PIDS+=($gw)
  wait_port $P_GW
  local key
  key=$(bench_key "http://127.0.0.1:$P_GW")
  ADMIN="$ADMIN" python3 - "$key" "$P_GW" "$DURATION" "$CLIENTS" "$name" "$MAX_RETRIES" $P_A $P_B $P_L <<'PY'
import json, sys, threading, time, urllib.request
from openai import OpenAI
key, port, duration, clients, name = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
max_retries = int(sys.argv[6])
sims = sys.argv[7:]
start = time.time()
lock = threading.Lock()
count = {"requests": 0, "ok": 0, "failed": 0}
outcomes = []  # (seconds since start at completion, answered)
opened = []    # (replica, seconds since start) each time its breaker was seen to leave "closed"
def watch():
    # The admin API's replica view, every 100 ms: when each replica's breaker opens.
    state = {}
    while time.time() - start < duration:
        try:
            r = urllib.request.Request(f"http://127.0.0.1:{port}/admin/v1/replicas",
                                       headers={"Authorization": f"Bearer {admin}"})
            with urllib.request.urlopen(r) as resp:
                for tier in json.load(resp)["data"]:
                    for rep in tier["replicas"]:
                        was = state.get(rep["name"], "closed")
                        if rep["breaker"] != "closed" and was == "closed":
                            opened.append((rep["name"], time.time() - start))
                        state[rep["name"]] = rep["breaker"]
        except Exception:
            pass
        time.sleep(0.1)
import os
admin = os.environ["ADMIN"]
def worker(i):
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, timeout=2.0,
                    max_retries=max_retries)
    n = 0
    while time.time() - start < duration:
        n += 1
        try:
            client.chat.completions.create(model="fast", max_tokens=8,
                messages=[{"role": "user", "content": f"client {i} question {n}"}])
            ok = True
        except Exception:
            ok = False
        with lock:
            count["requests"] += 1
            count["ok" if ok else "failed"] += 1
            outcomes.append((time.time() - start, ok))
threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
watcher = threading.Thread(target=watch)
watcher.start()
for t in threads: t.start()
for t in threads: t.join()
watcher.join()
time.sleep(6)  # late answers of the slow phase reach the simulators' counters
upstream = 0
for p in sims:
    with urllib.request.urlopen(f"http://127.0.0.1:{p}/sim/stats") as r:
        upstream += json.load(r)["requests"]
amp = upstream / max(count["requests"], 1)
print(f"{name:>12}: {count['requests']} client requests ({count['ok']} answered, {count['failed']} failed "
      f"after the SDK's retries), {upstream} upstream requests, amplification {amp:.2f}")
# Answered share per half second, and how long after each phase ended it was back at 95%.
step = 0.5
buckets = {}
for t, ok in outcomes:
    b = buckets.setdefault(int(t / step), [0, 0])
    b[0] += 1
    b[1] += ok
share = {k: v[1] / v[0] for k, v in buckets.items()}
print(" " * 14 + "answered share per second: " + " ".join(
    f"{share.get(2 * s, 1.0) * 0.5 + share.get(2 * s + 1, 1.0) * 0.5:.2f}" for s in range(int(duration))))
for label, fault_start, fault_end in (("replica a 503", 3, 11), ("tier 503", 13, 21), ("tier slow", 23, 33)):
    recovered = next((k * step - fault_end for k in sorted(share)
                      if k * step >= fault_end and all(share.get(j, 1.0) >= 0.95 for j in (k, k + 1))), None)
    rec = f"{recovered:.1f} s" if recovered is not None else "not within the run"
    print(f"{'':>14}{label} ({fault_start}-{fault_end} s): answered share back at 95% {rec} after it ended")
for label, fault_start, _ in (("replica a 503", 3, 11), ("tier 503", 13, 21), ("tier slow", 23, 33)):
    first = {}
    for rep, t in opened:
        if t >= fault_start and rep not in first:
            first[rep] = t - fault_start
    seen = ", ".join(f"{rep} {t:.1f} s" for rep, t in sorted(first.items())) or "none"
    print(f"{'':>14}{label}: breakers seen opening after the fault began: {seen}")
PY
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
