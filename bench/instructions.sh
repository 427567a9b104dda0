#!/usr/bin/env bash
# Instructions per request of the gateway, counted by valgrind's callgrind: the same number
# from run to run on a shared or busy machine, where time and CPU per request are noise. For
# one build configured two ways (or two builds), in front of the minimal upstream
# (gateway/examples/min_upstream.rs), one connection at a time.
#
#   bench/instructions.sh                                 # guard off (A) vs guard on (B), plain path
#   EXTRA_B=$'[cache]\nmode = "exact"' bench/instructions.sh
#   BIN_A=/tmp/old BIN_B=/tmp/new bench/instructions.sh   # two builds' directories, same config
#   LEDGER='spool_dir = "/tmp/spool"' BUDGETS=1 EXTRA_A=... bench/instructions.sh  # cost control on
#
# Each gateway runs under `valgrind --tool=callgrind`; WARM requests, then the counters are
# zeroed, then N requests, each a new question in one of 1,000 sessions (x-session-id), and the
# counters dumped. Prints instructions (user space, every thread of the process) per request for
# A and B and their difference (BODY_FILE=F sends F's chat body, a new user turn appended each
# time, instead of a one-line question, each `{n}` in it replaced by the request's number; BUDGETS=1 sets a day budget and rate limits for the tenant, as
# bench/ab-min.sh does); with KEEP=DIR the callgrind files stay in DIR for
# `callgrind_annotate --inclusive=yes DIR/A.out`. Needs valgrind (apt-get install valgrind), python3.
set -euo pipefail
cd "$(dirname "$0")/.."

N=${N:-2000}
WARM=${WARM:-300}
EXTRA=$'[cache]\nmode = "off"\n[guard]\nenabled = false'
EXTRA_A=${EXTRA_A:-$EXTRA}
EXTRA_B=${EXTRA_B:-$'[cache]\nmode = "off"\n[guard]\nenabled = true'}
LEDGER=${LEDGER:-enabled = false}
P_UP=${P_UP:-19601}

command -v valgrind >/dev/null || { echo "needs valgrind: apt-get install valgrind" >&2; exit 1; }
. bench/common.sh
BIN_A=${BIN_A:-$BIN}
BIN_B=${BIN_B:-$BIN}
OUT=${KEEP:-$WORK}
mkdir -p "$OUT"

"$(min_upstream)" --port "$P_UP" --threads 1 >"$WORK/up.log" 2>&1 &
PIDS+=($!)
wait_port "$P_UP"

# send URL KEY COUNT START: COUNT sequential requests on one keep-alive connection.
send() {
  python3 - "$@" <<'EOF'
import http.client, json, os, sys, urllib.parse
url, key, count, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
u = urllib.parse.urlparse(url)
conn = http.client.HTTPConnection(u.hostname, u.port)
base = json.load(open(os.environ["BODY_FILE"])) if os.environ.get("BODY_FILE") else None
for n in range(start, start + count):
    if base is None:
        body = json.dumps({"model": "fast", "max_tokens": 16, "messages": [
            {"role": "user", "content": f"Question {n}: what is the capital of France?"}]})
    else:
        # The file's body, its last message made new each time (an agent's next turn).
        # Each `{n}` in the file is replaced by the request's number (a body that never repeats).
        b = json.loads(json.dumps(base).replace("{n}", str(n)))
        b["messages"].append({"role": "user", "content": f"Turn {n}: go on."})
        body = json.dumps(b)
    conn.request("POST", "/v1/chat/completions", body, {
        "Content-Type": "application/json", "Authorization": f"Bearer {key}",
        "x-session-id": f"s{n % 1000}"})
    r = conn.getresponse()
    r.read()
    if r.status != 200:
        sys.exit(f"status {r.status}")
EOF
}

port=$((P_UP + 10))
for v in A B; do
  port=$((port + 1))
  bin=BIN_$v
  extra=EXTRA_$v
  { gateway_toml "$port" "$P_UP" "$WORK/$v.db" "$LEDGER"; echo "${!extra}"; } >"$WORK/$v.toml"
  RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$OUT/$v.out" \
    "${!bin}/gateway" serve --config "$WORK/$v.toml" >"$WORK/$v.log" 2>&1 &
  pid=$!
  PIDS+=($pid)
  for _ in $(seq 1 600); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.2; done
  url="http://127.0.0.1:$port"
  key=$(bench_key "$url" "${!bin}")
  if [ "${BUDGETS:-0}" = 1 ]; then
    bench_budgets "$url" "${!bin}"
  fi
  send "$url" "$key" "$WARM" 0
  callgrind_control -z "$pid" >/dev/null
  send "$url" "$key" "$N" "$WARM"
  callgrind_control -d "$pid" >/dev/null
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  # The dump after zeroing is the file with the highest part number.
  dump=$(ls -v "$OUT/$v.out".* 2>/dev/null | tail -1)
  ir=$(grep -m1 '^summary:' "$dump" | awk '{print $2}')
  echo "$v $ir" >>"$WORK/ir"
  cp "$dump" "$OUT/$v.last"
done

python3 - "$N" "$WORK/ir" <<'EOF'
import sys
n = int(sys.argv[1])
ir = dict(line.split() for line in open(sys.argv[2]))
a, b = int(ir["A"]) / n, int(ir["B"]) / n
print(f"instructions per request: A {a:,.0f}  B {b:,.0f}  B - A {b - a:+,.0f} ({100 * b / a:.1f}% of A)")
EOF
