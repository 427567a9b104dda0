#!/usr/bin/env bash
# Paired A/B comparison of two gateway builds' saturation throughput, interleaved so that the
# machine's drift (other load, thermal, noisy neighbours) falls on both sides alike.
#
#   bench/ab.sh A_DIR B_DIR        # each a directory with release `gateway` and `gatewayctl`
#   ROUNDS=8 DURATION=10s LEDGER=off bench/ab.sh /var/tmp/ab/82294a4 /var/tmp/ab/ab9560e
#   SESSIONS=10000 bench/ab.sh DIR_A DIR_B   # each request a new turn of one of 10,000 sessions
#
# A "build" may be a directory whose `gateway` is a wrapper setting an environment override
# (e.g. `GATEWAY__GUARD__ENABLED=false exec REAL/gateway "$@"`): the same binary, configured two
# ways.
#
# To build a commit's binaries into a directory:
#   git worktree add /var/tmp/ab/src-COMMIT COMMIT
#   (cd /var/tmp/ab/src-COMMIT && cargo build --release -p gateway --bins)
#   cp $CARGO_TARGET_DIR/release/{gateway,gatewayctl} /var/tmp/ab/COMMIT/
#
# Each round starts each build afresh (new SQLite store and ledger, so no build measures while
# another drains its queue), warms it up, then runs wrk at CONNS connections for DURATION against
# the zero-latency simulator (this checkout's build). The order alternates (AB, BA, AB, ...).
# Prints every round's req/s and, per build, the median; then B's median as a share of A's.
# Needs: wrk (apt-get install wrk), python3.
set -euo pipefail
cd "$(dirname "$0")/.."

A_DIR=$1
B_DIR=$2
ROUNDS=${ROUNDS:-6}
DURATION=${DURATION:-8s}
WARMUP=${WARMUP:-2s}
CONNS=${CONNS:-32}
LEDGER=${LEDGER:-on}
SESSIONS=${SESSIONS:-}
P_UP=${P_UP:-19201}
P_GW=${P_GW:-19202}

command -v wrk >/dev/null || { echo "needs wrk: apt-get install wrk" >&2; exit 1; }
for d in "$A_DIR" "$B_DIR"; do
  [ -x "$d/gateway" ] && [ -x "$d/gatewayctl" ] || { echo "$d lacks gateway/gatewayctl" >&2; exit 1; }
done

. bench/common.sh

"$SIM_BIN/gateway" simulate --profile zero --model sim-small --port "$P_UP" >"$WORK/sim.log" 2>&1 &
PIDS+=($!)
wait_port "$P_UP"

ledger_toml="enabled = false"
[ "$LEDGER" = on ] && ledger_toml="spool_dir = \"$WORK/spool\""

# measure SIDE DIR ROUND -> appends "SIDE ROUND req/s errors" to $WORK/results
measure() {
  local side=$1 dir=$2 round=$3 db="$WORK/$1-$3.db"
  gateway_toml "$P_GW" "$P_UP" "$db" "$ledger_toml" >"$WORK/ab.toml"
  RUST_LOG=warn "$dir/gateway" serve --config "$WORK/ab.toml" >"$WORK/$side-$round.log" 2>&1 &
  local pid=$!
  wait_port "$P_GW"
  local key
  key=$(bench_key "http://127.0.0.1:$P_GW" "$dir")
  local ask="What is the capital of France?"
  [ -n "$SESSIONS" ] && ask="$ask ({n})"
  wrk_post "$key" '{"model":"fast","messages":[{"role":"user","content":"'"$ask"'"}],"max_tokens":16}' "$SESSIONS" >"$WORK/ab.lua"
  wrk -t2 -c"$CONNS" -d"$WARMUP" -s "$WORK/ab.lua" "http://127.0.0.1:$P_GW/v1/chat/completions" >/dev/null
  local line
  line=$(wrk -t2 -c"$CONNS" -d"$DURATION" -s "$WORK/ab.lua" "http://127.0.0.1:$P_GW/v1/chat/completions" | grep '^WRK')
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  set -- $line
  python3 -c "print('$side', $round, round($2 / $3), $4)" | tee -a "$WORK/results"
}

for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) -eq 1 ]; then
    measure A "$A_DIR" "$round"; measure B "$B_DIR" "$round"
  else
    measure B "$B_DIR" "$round"; measure A "$A_DIR" "$round"
  fi
done

python3 - "$WORK/results" "$A_DIR" "$B_DIR" "$CONNS" "$DURATION" "$LEDGER" <<'PY'
import statistics, sys
path, a_dir, b_dir, conns, duration, ledger = sys.argv[1:]
rows = [l.split() for l in open(path)]
by = {"A": [], "B": []}
for side, _, rps, errors in rows:
    by[side].append(int(rps))
    if int(errors):
        print(f"warning: {errors} errors in a round of {side}")
ma, mb = statistics.median(by["A"]), statistics.median(by["B"])
print(f"\nwrk -c{conns} -d{duration}, ledger {ledger}, {len(by['A'])} rounds each, interleaved")
print(f"| build | req/s per round | median |")
print(f"|---|---|---|")
print(f"| A {a_dir} | {', '.join(map(str, by['A']))} | {ma:.0f} |")
print(f"| B {b_dir} | {', '.join(map(str, by['B']))} | {mb:.0f} |")
pairs = [b / a for a, b in zip(by["A"], by["B"])]
print(f"\nB / A: median of medians {100 * mb / ma:.1f}%; per round {', '.join(f'{100*p:.0f}%' for p in pairs)}")
PY
