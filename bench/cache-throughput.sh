#!/usr/bin/env bash
# What the response cache buys end to end: requests/s and latency through the gateway with the
# cache off, exact only, and exact + semantic, at a workload where 30% of the requests repeat an
# earlier question word for word, all measured in the same run against the same simulated small
# model server (realistic timing: time to first token plus 8 ms per generated token).
#
#   bench/cache-throughput.sh                # 20 s per measurement
#   DURATION=30s CONNS=32 bench/cache-throughput.sh
#
# What a semantic miss costs (issue 19, item 3): UPSTREAM=min puts the minimal upstream
# (gateway/examples/min_upstream.rs) in place of the simulator and measures it directly first;
# GATE=T adds a run with the semantic layer's first stage on (cache.semantic.gate_overlap = T),
# STUDENT=T one with the learned first stage (cache.semantic.gate_student = T);
# SUFFIX=0 sends each question as it is instead of with a " (n)" counter (real questions share no
# such token). Every semantic gateway loads the model at start (preload); SEMANTIC_TOML adds
# lines to its [cache.semantic] section (e.g. "threads = 2", or 'device = "cuda"' with a
# `--features cuda` build). MODEL=DIR takes the model from DIR instead of fetching it (the GPU
# bundle's fp16 copy); MODES lists the gateway runs (default "off exact semantic").
# MEMORY=1 prints each gateway's resident size after its load with what the exact cache counts
# (`gateway_cache_bytes`, `gateway_cache_entries`): what `cache.max_bytes` bounds against the
# memory it holds (issue 19, item 4).
#
#   UPSTREAM=min GATE=0.15 SUFFIX=0 REPEAT=0 CONNS=1 DURATION=10s BIN=DIR bench/cache-throughput.sh
#
# Questions are the `a` side of ../shared/data/qqp-dev.jsonl (real, varied questions), sent with
# temperature 0 and max_tokens 16. Each wrk connection draws a new question with probability 0.7,
# and otherwise repeats one of the 200 most recent ones. Hit counts come from the gateway's own
# metrics. Needs: wrk (apt-get install wrk), python3.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-20s}
CONNS=${CONNS:-16}
REPEAT=${REPEAT:-0.3}
PAIRS=${PAIRS:-../shared/data/qqp-dev.jsonl}
P_UP=${P_UP:-19301}
P_OFF=${P_OFF:-19302}
P_EXACT=${P_EXACT:-19303}
P_SEM=${P_SEM:-19304}
P_GATE=${P_GATE:-19305}
UPSTREAM=${UPSTREAM:-sim}
GATE=${GATE:-}
STUDENT=${STUDENT:-}
P_STUDENT=${P_STUDENT:-19306}
SUFFIX=${SUFFIX:-1}
SEMANTIC_TOML=${SEMANTIC_TOML:-}

MODES=${MODES:-off exact semantic}

command -v wrk >/dev/null || { echo "needs wrk: apt-get install wrk" >&2; exit 1; }
if [ -n "${MODEL:-}" ]; then
  SEMANTIC_TOML="model_dir = \"$MODEL\"
$SEMANTIC_TOML"
else
  scripts/fetch-model.sh >/dev/null
fi
. bench/common.sh

python3 - "$PAIRS" "$WORK/questions.txt" <<'EOF'
import json, sys
seen, out = set(), []
for line in open(sys.argv[1]):
    q = json.loads(line)["a"].replace("\n", " ").strip()
    if q and q not in seen:
        seen.add(q); out.append(q)
open(sys.argv[2], "w").write("\n".join(out) + "\n")
EOF

cat >"$WORK/load.lua" <<'EOF'
local questions = {}
for line in io.lines(os.getenv("QUESTIONS")) do questions[#questions + 1] = line end
local repeat_share = tonumber(os.getenv("REPEAT"))
local suffix = os.getenv("SUFFIX") ~= "0"
local key = os.getenv("KEY")
local threads = 0
function setup(thread) thread:set("tid", threads); threads = threads + 1 end
local recent, next_q = {}, 0
function init(args)
  math.randomseed(tid * 7919 + 17)
  next_q = tid * 100000
end
local function escape(s) return (s:gsub('\\', '\\\\'):gsub('"', '\\"')) end
function request()
  local q
  if #recent > 0 and math.random() < repeat_share then
    q = recent[math.random(#recent)]
  else
    next_q = next_q + 1
    q = questions[(next_q % #questions) + 1]
    if suffix then q = q .. " (" .. next_q .. ")" end
    recent[#recent % 200 + 1] = q
  end
  local body = '{"model":"fast","temperature":0,"max_tokens":16,"messages":[{"role":"user","content":"' .. escape(q) .. '"}]}'
  return wrk.format("POST", "/v1/chat/completions",
    {["Content-Type"] = "application/json", ["Authorization"] = "Bearer " .. key}, body)
end
EOF

if [ "$UPSTREAM" = min ]; then
  "$(min_upstream)" --port "$P_UP" --threads 1 >"$WORK/upstream.log" 2>&1 &
else
  "$SIM_BIN/gateway" simulate --profile small --model sim-small --port "$P_UP" >"$WORK/sim.log" 2>&1 &
fi
PIDS+=($!)
wait_port "$P_UP"

metric() { # PORT LAYER RESULT
  http_get "http://127.0.0.1:$1/metrics" |
    awk -v l="$2" -v r="$3" '$0 ~ "^gateway_cache_lookups_total\\{layer=\""l"\",result=\""r"\"\\}" {print $2}'
}

printf '| cache | requests/s | p50 ms | p99 ms | exact hits | semantic hits | semantic misses embedded | semantic misses gated | semantic skipped |\n|---|---|---|---|---|---|---|---|---|\n' >"$WORK/table.md"
load() { # NAME PORT KEY
  QUESTIONS="$WORK/questions.txt" REPEAT="$REPEAT" SUFFIX="$SUFFIX" KEY=$3 \
    wrk -t"$(( CONNS < 2 ? 1 : 2 ))" -c"$CONNS" -d"$DURATION" --latency -s "$WORK/load.lua" "http://127.0.0.1:$2" >"$WORK/$1.wrk"
}
if [ "$UPSTREAM" = min ]; then
  load direct "$P_UP" none
  printf '| direct (no gateway) | %s | %s | %s | | | | | |\n' "$(awk '/^Requests\/sec/ {print $2}' "$WORK/direct.wrk")" \
    "$(awk '$1 == "50%" {print $2}' "$WORK/direct.wrk")" "$(awk '$1 == "99%" {print $2}' "$WORK/direct.wrk")" >>"$WORK/table.md"
fi
run() { # NAME PORT MODE [EXTRA_TOML]
  start_gateway "$1" "$2" "$P_UP" "[cache]
mode = \"$3\"
[cache.semantic]
preload = true
$SEMANTIC_TOML
${4:-}"
  if [ "$3" = semantic ]; then
    local ready=0
    for _ in $(seq 1 240); do
      http_get "http://127.0.0.1:$2/metrics" | grep -q '^gateway_cache_semantic_ready 1' && { ready=1; break; }
      sleep 0.5
    done
    # Which device the layer runs on (or why it did not load), from the gateway's log.
    { grep semantic "$WORK/$1.log" || true; } | tail -3
    [ "$ready" = 1 ] || { echo "$1: the semantic layer was not ready after 120 s" >&2; exit 1; }
  fi
  local gw_pid=${PIDS[${#PIDS[@]}-1]}
  load "$1" "$2" "$(cat "$WORK/$1.key")"
  if [ "${MEMORY:-0}" = 1 ]; then
    local m
    m=$(http_get "http://127.0.0.1:$2/metrics")
    printf 'memory %s: VmRSS %s kB, gateway_cache_bytes %s, gateway_cache_entries %s\n' "$1" \
      "$(awk '/^VmRSS/ {print $2}' "/proc/$gw_pid/status")" \
      "$(echo "$m" | awk '$1 == "gateway_cache_bytes" {print $2}')" \
      "$(echo "$m" | awk '$1 == "gateway_cache_entries" {print $2}')"
  fi
  local rps p50 p99
  rps=$(awk '/^Requests\/sec/ {print $2}' "$WORK/$1.wrk")
  p50=$(awk '$1 == "50%" {print $2}' "$WORK/$1.wrk")
  p99=$(awk '$1 == "99%" {print $2}' "$WORK/$1.wrk")
  printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$1" "$rps" "$p50" "$p99" \
    "$(metric "$2" exact hit)" "$(metric "$2" semantic hit)" "$(metric "$2" semantic miss)" \
    "$(metric "$2" semantic gated)" "$(metric "$2" semantic skipped)" >>"$WORK/table.md"
  grep -q 'Non-2xx' "$WORK/$1.wrk" && { echo "$1: errors:"; cat "$WORK/$1.wrk"; }
  return 0
}

for mode in $MODES; do
  case $mode in
    off) run off "$P_OFF" off ;;
    exact) run exact "$P_EXACT" exact ;;
    semantic) run semantic "$P_SEM" semantic ;;
    *) echo "MODES: unknown mode $mode (off, exact, semantic)" >&2; exit 1 ;;
  esac
done
if [ -n "$GATE" ]; then
  run semantic-gate "$P_GATE" semantic "gate_overlap = $GATE"
fi
if [ -n "$STUDENT" ]; then
  run semantic-student "$P_STUDENT" semantic "gate_student = $STUDENT"
fi
echo "connections $CONNS, $DURATION each, repeat share $REPEAT, upstream: $UPSTREAM, suffix $SUFFIX"
cat "$WORK/table.md"
