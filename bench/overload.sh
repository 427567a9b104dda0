#!/usr/bin/env bash
# Overload: offer 10× a tier's capacity and see what the admitted requests and the refused ones
# get. One simulated replica (`small` profile, batching MAX_RUNNING sequences, more wait in its
# queue); the gateway in front with its defaults (max_concurrency 64, queue 256 × QUEUE_WAIT_MS,
# adaptive concurrency on), the SQLite ledger on and a budget on the tenant.
#
#   1. capacity: CONNS clients in a closed loop for 8 s -> C answers a second;
#   2. overload: open loop at FACTOR × C for DURATION s (a new connection per request);
#      admitted (200) and refused (503) latency p50/p99/max, refused at once vs after the wait;
#   3. nothing charged for a refusal (the ledger's 503 rows), no reservation left (admin API).
#
# Run twice: adaptive concurrency on (as shipped), then off (the fixed max_concurrency).
#   BIN=/var/tmp/gw-target/debug bench/overload.sh     # or let bench/common.sh build release
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
MAX_RUNNING=${MAX_RUNNING:-4}
FACTOR=${FACTOR:-10}
DURATION=${DURATION:-15}
QUEUE_WAIT_MS=${QUEUE_WAIT_MS:-1000}
CONNS=${CONNS:-16}
P_S=19401 P_GW=19402

run() {
  local name=$1 extra=$2
  "$SIM_BIN/gateway" simulate --profile small --model sim-small --port $P_S \
    --max-running "$MAX_RUNNING" >"$WORK/sim-$name.log" 2>&1 &
  local s=$!
  PIDS+=($s)
  wait_port $P_S
  {
    toml_head $P_GW "$WORK/$name.db"
    cat <<TOML
[tiers.small]
replicas = [{ name = "s", url = "http://127.0.0.1:$P_S/v1", model = "sim-small", max_concurrency = 64 }]
[tiers.large]
replicas = [{ name = "l", url = "http://127.0.0.1:$P_S/v1", model = "sim-small" }]
[models]
fast = "small"
[prices.sim-small]
input = 0.15
output = 0.60
[ledger]
spool_dir = "$WORK/spool-$name"
[cache]
mode = "off"
[upstream]
fallback_to_other_tier = false
queue_wait_ms = $QUEUE_WAIT_MS
$extra
TOML
  } >"$WORK/$name.toml"
  RUST_LOG=error "$BIN/gateway" serve --config "$WORK/$name.toml" >"$WORK/$name.log" 2>&1 &
  local gw=$!
  PIDS+=($gw)
  wait_port $P_GW
  local key
  key=$(bench_key "http://127.0.0.1:$P_GW")
  GATEWAY_URL="http://127.0.0.1:$P_GW" GATEWAY_ADMIN_TOKEN=$ADMIN "$BIN/gatewayctl" \
    budgets set --tenant bench --window day --tokens 1000000000 >/dev/null
  echo "== $name"
  python3 - "$key" "$P_GW" "$DURATION" "$FACTOR" "$CONNS" "$ADMIN" "$WORK/$name.db" <<'PY'
import asyncio, json, sqlite3, sys, time, urllib.request
key, port, duration, factor, conns, admin, db = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), \
    float(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7]
sent = 0

def request():
    # A distinct question each time: the same request again after an error would be a retry.
    global sent
    sent += 1
    body = json.dumps({"model": "fast", "max_tokens": 16, "messages": [
        {"role": "user", "content": f"Tell me about overload, question {sent}."}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return head + body

async def one():
    t = time.perf_counter()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(request())
    await w.drain()
    data = await r.read()
    w.close()
    status = int(data.split(b" ", 2)[1]) if data else 0
    return status, time.perf_counter() - t, data

async def closed_loop(seconds):
    done, end = 0, time.perf_counter() + seconds
    async def client():
        nonlocal done
        while time.perf_counter() < end:
            s, _, _ = await one()
            done += s == 200
    await asyncio.gather(*(client() for _ in range(conns)))
    return done / seconds

async def open_loop(rate, seconds):
    tasks, start, n = [], time.perf_counter(), int(rate * seconds)
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    return await asyncio.gather(*tasks)

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000 if xs else float("nan")

def refused_rows():
    return sqlite3.connect(db).execute(
        "select count(*), coalesce(sum(cost_micros), 0) from ledger where status = 503").fetchone()

capacity = asyncio.run(closed_loop(8))
time.sleep(3)  # the ledger writer flushes
before = refused_rows()
rate = capacity * factor
results = asyncio.run(open_loop(rate, duration))
ok = [t for s, t, _ in results if s == 200]
refused = [(t, d) for s, t, d in results if s == 503]
other = [s for s, _, _ in results if s not in (200, 503)]
at_once = [t for t, d in refused if b"would wait about" in d or b"queue_depth" in d]
after = [t for t, d in refused if b"stayed at capacity" in d]
print(f"capacity {capacity:.1f} answers/s; offered {rate:.0f}/s for {duration:.0f} s: "
      f"{len(results)} requests, {len(ok)} admitted, {len(refused)} refused (503), {len(other)} other {sorted(set(other))}")
print(f"admitted: p50 {pct(ok, .5):.0f} ms, p99 {pct(ok, .99):.0f} ms, max {pct(ok, 1):.0f} ms")
rt = [t for t, _ in refused]
print(f"refused:  p50 {pct(rt, .5):.1f} ms, p99 {pct(rt, .99):.1f} ms, max {pct(rt, 1):.1f} ms; "
      f"{len(at_once)} at once (queue full or expected wait), {len(after)} after waiting")
time.sleep(3)  # the ledger writer flushes
req = urllib.request.Request(f"http://127.0.0.1:{port}/admin/v1/usage?tenant=bench",
                             headers={"Authorization": f"Bearer {admin}"})
reserved = sum(r["state"]["reserved_tokens"] for r in json.load(urllib.request.urlopen(req))["data"])
after = refused_rows()
print(f"ledger: {after[0] - before[0]} rows for the {len(refused)} refusals, charged "
      f"{after[1] - before[1]} micro-USD in all; budget reservations left: {reserved} tokens")
PY
  kill $gw $s 2>/dev/null || true
  wait $gw $s 2>/dev/null || true
  sleep 1
}

run adaptive ""
run fixed "adaptive_concurrency = false"
