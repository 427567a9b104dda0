#!/usr/bin/env bash
# The proxy hop against nginx, side by side in one run (issue 19): a minimal upstream
# (gateway/examples/min_upstream.rs: one write per answer, 16 completion tokens), nginx
# `proxy_pass` with upstream keep-alive, and the gateway in each configuration below, each
# measured in every round, in the same order, at saturation with wrk and with oha, and at one
# connection for the latency it adds over calling the upstream directly. Prints the ratio table.
#
#   bench/proxy-compare.sh                       # 2 rounds, 10 s per measurement
#   ROUNDS=3 SAT=15s CONFIGS="plain sqlite" bench/proxy-compare.sh
#
# Load: wrk sends every request as a new question in one of SESSIONS sessions per thread (as
# many users and agents do, so no session looks like a loop); oha cannot vary a body, so it
# repeats one request (to the guard, one session asking the same thing: flagged as a loop, which
# the `flag` action answers anyway). wrk is the representative figure; oha is the second opinion.
#
# Besides nginx, `floor` is gateway/examples/min_proxy.rs: a proxy with no logic built from the
# gateway's own stack (tokio, hyper server, hyper_util pooled client), so the table separates
# what the stack costs from what the gateway's pipeline adds.
#
# Configurations (all with tenant `bench` and one key):
#   plain    ledger off, no budget policy, cache off, guard off: the proxy hop itself
#   sqlite   the embedded default's cost control: SQLite ledger (journal on), in-process budgets
#            with a day budget and rate limits set, exact-cache policy (bypassed: no
#            temperature 0), guard on (agent loops, retry budget)
#   pg       Postgres ledger and store, Redis budgets (leases), exact-cache policy shared through
#            Redis (bypassed), guard on with its Redis session windows
# Needs: nginx, wrk (apt-get install nginx wrk), oha (cargo install oha --locked; skipped with a
# note when missing), python3; `pg` needs Postgres (PGURL, default the test database's server)
# and redis-server.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-2}
SAT=${SAT:-10s}
LAT=${LAT:-10s}
CONNS=${CONNS:-64}
CONFIGS=${CONFIGS:-plain sqlite pg}
UP_THREADS=${UP_THREADS:-1}
SESSIONS=${SESSIONS:-1000}
PGURL=${PGURL:-postgres://postgres@127.0.0.1:5432}
P_UP=${P_UP:-19301}
P_NGINX=${P_NGINX:-19302}
P_REDIS=${P_REDIS:-19303}
P_FLOOR=${P_FLOOR:-19304}
declare -A PORT=([plain]=19311 [sqlite]=19312 [pg]=19313)

command -v nginx >/dev/null || { echo "needs nginx: apt-get install nginx" >&2; exit 1; }
command -v wrk >/dev/null || { echo "needs wrk: apt-get install wrk" >&2; exit 1; }
HAVE_OHA=1
command -v oha >/dev/null || { HAVE_OHA=0; echo "oha not found (cargo install oha --locked): wrk only" >&2; }

. bench/common.sh
UPSTREAM=$(min_upstream)

"$UPSTREAM" --port "$P_UP" --threads "$UP_THREADS" >"$WORK/upstream.log" 2>&1 &
PIDS+=($!)
wait_port "$P_UP"

start_nginx "$P_NGINX" "$P_UP"
"$(example_bin min_proxy)" --port "$P_FLOOR" --upstream "127.0.0.1:$P_UP" >"$WORK/floor.log" 2>&1 &
PIDS+=($!)
wait_port "$P_FLOOR"

for name in $CONFIGS; do
  start_cost_config "$name" "${PORT[$name]}" "$P_UP" "$P_REDIS" "$PGURL"
done

# Traffic as many agents and users send it: SESSIONS sessions (x-session-id) per wrk thread,
# each request a new question ("{n}" is a counter), so the guard sees many sessions and none
# repeating itself. Every target gets the same script, so the load generator's cost is the same.
BODY_DIRECT='{"model":"sim-small","messages":[{"role":"user","content":"Question {n}: what is the capital of France?"}],"max_tokens":16}'
BODY_GW='{"model":"fast","messages":[{"role":"user","content":"Question {n}: what is the capital of France?"}],"max_tokens":16}'

target_url() {
  case $1 in
    direct) echo "http://127.0.0.1:$P_UP/v1/chat/completions" ;;
    nginx) echo "http://127.0.0.1:$P_NGINX/v1/chat/completions" ;;
    floor) echo "http://127.0.0.1:$P_FLOOR/v1/chat/completions" ;;
    *) echo "http://127.0.0.1:${PORT[$1]}/v1/chat/completions" ;;
  esac
}
target_body() { case $1 in direct | nginx | floor) echo "$BODY_DIRECT" ;; *) echo "$BODY_GW" ;; esac; }
target_key() { case $1 in direct | nginx | floor) echo none ;; *) cat "$WORK/$1.key" ;; esac; }

# Wait until a gateway's ledger queue is empty, so its writer does not run into the next phase.
drain() {
  [ -f "$WORK/gw-$1.pid" ] || return 0
  ledger_drain "${PORT[$1]}"
}

: >"$WORK/results"
TARGETS="direct nginx floor $CONFIGS"
for round in $(seq 1 "$ROUNDS"); do
  for t in $TARGETS; do
    url=$(target_url "$t") body=$(target_body "$t") key=$(target_key "$t")
    wrk_post "$key" "$body" "$SESSIONS" >"$WORK/sat.lua"
    wrk -t2 -c"$CONNS" -d2s -s "$WORK/sat.lua" "$url" >/dev/null # warm up
    drain "$t"
    w=$(wrk -t2 -c"$CONNS" -d"$SAT" -s "$WORK/sat.lua" "$url" | awk '/^WRK/ {print $2, $3, $4}')
    drain "$t"
    o="- - -"
    if [ "$HAVE_OHA" = 1 ]; then
      o=$(oha --no-tui --output-format json -m POST -H "Content-Type: application/json" \
        -H "Authorization: Bearer $key" -d "${body//\{n\}/1}" -z "$SAT" -c "$CONNS" "$url" |
        python3 -c 'import json,sys
d = json.load(sys.stdin); codes = d.get("statusCodeDistribution", {})
print(d["summary"]["requestsPerSec"], sum(codes.values()), sum(v for k, v in codes.items() if k != "200"))')
      drain "$t"
    fi
    l=$(wrk -t1 -c1 -d"$LAT" -s "$WORK/sat.lua" "$url" | awk '/^LAT/ {print $2, $3, $4, $5}')
    drain "$t"
    echo "$round $t $w $o $l" | tee -a "$WORK/results" >&2
  done
done

for name in $CONFIGS; do
  spooled=$(http_get "http://127.0.0.1:${PORT[$name]}/metrics" |
    awk '/^gateway_ledger_rows_total\{outcome="(spooled|overflow_spooled)"\}/ {s += $2} END {print s + 0}')
  echo "spooled $name $spooled" >>"$WORK/results"
done

python3 - "$WORK/results" "$CONNS" "$SAT" "$LAT" <<'PY'
import sys
from collections import defaultdict
path, conns, sat, lat = sys.argv[1:5]
rows = defaultdict(dict)
spooled = {}
for line in open(path):
    f = line.split()
    if f[0] == "spooled":
        spooled[f[1]] = f[2]
        continue
    rnd, t = int(f[0]), f[1]
    wrk_n, wrk_s, wrk_err = int(f[2]), float(f[3]), int(f[4])
    oha = None if f[5] == "-" else (float(f[5]), int(f[6]), int(f[7]))
    p50, p99, lat_n, lat_err = float(f[8]), float(f[9]), int(f[10]), int(f[11])
    rows[rnd][t] = dict(wrk=wrk_n / wrk_s, wrk_err=wrk_err, oha=oha, p50=p50, p99=p99, lat_err=lat_err)
targets = list(rows[1].keys())
print(f"\nsaturation at {conns} connections ({sat} per tool), latency at 1 connection ({lat});"
      " % of nginx in the same round; added = minus direct")
print("| path | round | wrk req/s | % nginx (wrk) | oha req/s | % nginx (oha) | c=1 p50 / p99 ms | added p50 / p99 ms | non-2xx |")
print("|---|---|---|---|---|---|---|---|---|")
for t in targets:
    for rnd in sorted(rows):
        r, n, d = rows[rnd][t], rows[rnd]["nginx"], rows[rnd]["direct"]
        oha = f"{r['oha'][0]:,.0f}" if r["oha"] else "-"
        oha_pct = f"{100 * r['oha'][0] / n['oha'][0]:.0f}%" if r["oha"] and n["oha"] else "-"
        errs = r["wrk_err"] + r["lat_err"] + (r["oha"][2] if r["oha"] else 0)
        print(f"| {t} | {rnd} | {r['wrk']:,.0f} | {100 * r['wrk'] / n['wrk']:.0f}% | {oha} | {oha_pct} "
              f"| {r['p50']:.3f} / {r['p99']:.3f} | {r['p50'] - d['p50']:+.3f} / {r['p99'] - d['p99']:+.3f} | {errs} |")
for name, n in spooled.items():
    print(f"ledger rows spooled by {name}: {n}")
PY
