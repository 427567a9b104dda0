# Shared by the bench/ scripts (sourced, after `cd` to the repository root): builds the release
# binaries, makes a work directory removed on exit with every process started in PIDS, and
# starts gateways in front of the simulator.

# BIN=DIR runs another build's binaries (bench/ab.sh's directories) instead of building this one;
# SIM_BIN=DIR takes the simulator from another build (default: BIN).
if [ -z "${BIN:-}" ]; then
  cargo build --release -q -p gateway --bins
  BIN=${CARGO_TARGET_DIR:-target}/release
fi
SIM_BIN=${SIM_BIN:-$BIN}
WORK=$(mktemp -d)
PIDS=()
ADMIN=bench-admin-token
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  # Gone before the next script starts: a Redis or gateway still closing would hold its port.
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  if [ -f "$WORK/nginx.pid" ]; then kill "$(cat "$WORK/nginx.pid")" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

# http_get URL: the body of a GET, with curl where there is one, else Python (the GPU machine).
http_get() {
  if command -v curl >/dev/null; then
    curl -s "$1"
  else
    python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' "$1" 2>/dev/null
  fi
}

# ledger_drain PORT: wait (at most 2 minutes) until the gateway on PORT has written every queued
# ledger row, so that its writer does not run into the next measurement.
ledger_drain() {
  local depth
  for _ in $(seq 1 600); do
    depth=$(http_get "http://127.0.0.1:$1/metrics" | awk '/^gateway_ledger_queue_depth / {print $2}')
    [ "${depth:-0}" = 0 ] && return 0
    sleep 0.2
  done
}

wait_port() { for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; echo "port $1 never opened" >&2; exit 1; }

# min_upstream: the path of the minimal upstream (gateway/examples/min_upstream.rs): BIN's when
# BIN names a build that has it, else built here.
example_bin() {
  if [ -x "$BIN/examples/$1" ]; then
    echo "$BIN/examples/$1"
  else
    cargo build --release -q -p gateway --example "$1"
    echo "${CARGO_TARGET_DIR:-target}/release/examples/$1"
  fi
}
min_upstream() { example_bin min_upstream; }

# start_nginx PORT UPSTREAM_PORT: nginx as one plain reverse-proxy hop on PORT in front of
# UPSTREAM_PORT, with upstream keep-alive and one worker process (stopped on exit).
start_nginx() {
  mkdir -p "$WORK/nginx"
  cat >"$WORK/nginx.conf" <<EOF
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/nginx/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $WORK/nginx; proxy_temp_path $WORK/nginx;
  fastcgi_temp_path $WORK/nginx; uwsgi_temp_path $WORK/nginx; scgi_temp_path $WORK/nginx;
  upstream up { server 127.0.0.1:$2; keepalive 128; }
  server {
    listen 127.0.0.1:$1;
    location / {
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
EOF
  nginx -c "$WORK/nginx.conf"
  wait_port "$1"
}

# toml_head PORT DB: the [server], [store] and [admin] sections of a benchmark gateway listening
# on PORT with its embedded SQLite store at DB.
toml_head() {
  cat <<EOF
[server]
listen = "127.0.0.1:$1"
[store]
url = "sqlite://$2"
[admin]
token = "$ADMIN"
EOF
}

# gateway_toml PORT UPSTREAM_PORT DB LEDGER_BODY: the benchmark gateway's configuration on stdout
# (embedded SQLite store at DB, both tiers on the simulator at UPSTREAM_PORT serving `sim-small`,
# model `fast`, priced; LEDGER_BODY is the body of its [ledger] section). With AUTO=1 the model
# `auto` is routed by the tier router too (its classifier needs scripts/fetch-model.sh); with
# TWO=1 the small tier has a second replica on the same upstream, so prefix affinity chooses.
gateway_toml() {
  toml_head "$1" "$3"
  cat <<EOF
[tiers.small]
replicas = [{ name = "sim", url = "http://127.0.0.1:$2/v1", model = "sim-small", max_concurrency = 4096 }${TWO:+, { name = \"sim2\", url = \"http://127.0.0.1:$2/v1\", model = \"sim-small\", max_concurrency = 4096 \}}]
[tiers.large]
replicas = [{ name = "sim-l", url = "http://127.0.0.1:$2/v1", model = "sim-small", max_concurrency = 4096 }]
[models]
fast = "small"
${AUTO:+auto = \"auto\"}
[prices.sim-small]
input = 0.15
output = 0.60
[ledger]
$4
EOF
}

# affinity_toml PORT DB CHOICE SIM_PORT...: a gateway whose small tier is the simulators at
# SIM_PORTs (each scraped at /metrics), choosing replicas by CHOICE (upstream.replica_choice);
# ledger, cache and guard off, so only replica choice differs between runs.
affinity_toml() {
  local port=$1 db=$2 choice=$3
  shift 3
  echo "[server]
listen = \"127.0.0.1:$port\"
[store]
url = \"sqlite://$db\"
[admin]
token = \"$ADMIN\"
[tiers.small]
replicas = ["
  local i=0
  for p in "$@"; do
    echo "  { name = \"s$i\", url = \"http://127.0.0.1:$p/v1\", model = \"sim-small\", metrics_url = \"http://127.0.0.1:$p/metrics\" },"
    i=$((i + 1))
  done
  echo "]
[tiers.large]
replicas = [{ name = \"l\", url = \"http://127.0.0.1:$1/v1\", model = \"sim-small\" }]
[models]
fast = \"small\"
[ledger]
enabled = false
[cache]
mode = \"off\"
[guard]
enabled = false
[upstream]
replica_choice = \"$choice\"
scrape_interval_ms = 250"
}

# bench_key URL [BIN_DIR]: create tenant `bench` on the gateway at URL and print a key of it,
# with BIN_DIR's gatewayctl (default: this checkout's).
bench_key() {
  local ctl="${2:-$BIN}/gatewayctl"
  GATEWAY_URL=$1 GATEWAY_ADMIN_TOKEN=$ADMIN "$ctl" tenants create bench >/dev/null
  GATEWAY_URL=$1 GATEWAY_ADMIN_TOKEN=$ADMIN "$ctl" --json keys create --tenant bench |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])'
}

# bench_budgets URL [BIN_DIR]: give tenant `bench` on the gateway at URL a day budget (tokens
# and USD) and rate limits far above what any run uses, so every request does the budget step
# (reserve, prompt token count, commit) and none is refused; with BIN_DIR's gatewayctl.
bench_budgets() {
  local ctl="${2:-$BIN}/gatewayctl"
  GATEWAY_URL=$1 GATEWAY_ADMIN_TOKEN=$ADMIN "$ctl" budgets set --tenant bench \
    --window day --tokens 1000000000000 --usd 1000000 >/dev/null
  GATEWAY_URL=$1 GATEWAY_ADMIN_TOKEN=$ADMIN "$ctl" limits set --tenant bench \
    --rpm 1000000000 --tpm 1000000000000 >/dev/null
}

# start_gateway NAME PORT UPSTREAM_PORT EXTRA_TOML: a gateway with the ledger off (see
# gateway_toml), with tenant `bench` and its key in $WORK/NAME.key (its log level: GATEWAY_LOG,
# default warn). EXTRA_TOML is appended to the config.
start_gateway() {
  { gateway_toml "$2" "$3" "$WORK/$1.db" "enabled = false"; echo "$4"; } >"$WORK/$1.toml"
  RUST_LOG=${GATEWAY_LOG:-warn} "$BIN/gateway" serve --config "$WORK/$1.toml" >"$WORK/$1.log" 2>&1 &
  PIDS+=($!)
  if ! (wait_port "$2"); then
    echo "gateway $1 did not start; its log:" >&2
    tail -20 "$WORK/$1.log" >&2
    exit 1
  fi
  export GATEWAY_URL="http://127.0.0.1:$2" GATEWAY_ADMIN_TOKEN=$ADMIN
  bench_key "$GATEWAY_URL" >"$WORK/$1.key"
}

# start_semantic NAME P_UP P_GW STAGE: the minimal upstream on P_UP and gateway NAME on P_GW in
# front of it with the semantic cache on and its model preloaded (STAGE: more [cache.semantic]
# lines), returning once the semantic layer is ready (or after two minutes).
start_semantic() {
  "$(min_upstream)" --port "$2" --threads 1 >"$WORK/up-$1.log" 2>&1 &
  PIDS+=($!)
  wait_port "$2"
  start_gateway "$1" "$3" "$2" "[cache]
mode = \"semantic\"
[cache.semantic]
preload = true
model_dir = \"$(pwd)/models/all-MiniLM-L6-v2\"
$4"
  for _ in $(seq 1 240); do
    http_get "http://127.0.0.1:$3/metrics" | grep -q '^gateway_cache_semantic_ready 1' && return 0
    sleep 0.5
  done
}

# wrk_post KEY BODY [SESSIONS]: a wrk script on stdout that POSTs JSON BODY with bearer KEY and,
# when done, prints one line "WRK <requests> <seconds> <errors>" and one line
# "LAT <p50 ms> <p99 ms> <requests> <errors>". With SESSIONS, each request
# is a new turn: "{n}" in BODY becomes a request counter and x-session-id cycles through
# SESSIONS ids per wrk thread (so the guard sees many sessions, none repeating itself).
wrk_post() {
  cat <<EOF
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer $1"
wrk.body = '$2'
local sessions = tonumber("${3:-0}")
local n = 0
local threads = 0
setup = function(thread)
  threads = threads + 1
  thread:set("tid", threads)
end
if sessions > 0 then
  request = function()
    n = n + 1
    wrk.headers["x-session-id"] = "s" .. tostring(n % sessions) .. "-t" .. tostring(tid)
    return wrk.format(nil, nil, nil, (string.gsub(wrk.body, "{n}", tostring(n))))
  end
end
done = function(summary, latency, requests)
  local errors = summary.errors.status + summary.errors.connect + summary.errors.timeout
  io.write(string.format("WRK %d %.3f %d\\n", summary.requests, summary.duration / 1e6, errors))
  io.write(string.format("LAT %.4f %.4f %d %d\\n", latency:percentile(50) / 1000,
    latency:percentile(99) / 1000, summary.requests, errors))
end
EOF
}

# cost_config NAME PORT UPSTREAM_PORT REDIS_PORT PG_DB_URL: bench/proxy-compare.sh's gateway
# configuration NAME on stdout:
#   plain    ledger off, no budget policy, cache off, guard off
#   sqlite   the embedded default's cost control: SQLite ledger (journal on), in-process budgets,
#            exact-cache policy, guard on
#   pg       Postgres ledger and store (PG_DB_URL), Redis budgets (leases) and exact cache at
#            REDIS_PORT, guard on with its session windows in that Redis
cost_config() {
  local name=$1 port=$2 up=$3 redis=$4 db=$5
  case $name in
    plain)
      gateway_toml "$port" "$up" "$WORK/plain.db" "enabled = false"
      printf '[cache]\nmode = "off"\n[guard]\nenabled = false\n' ;;
    sqlite)
      gateway_toml "$port" "$up" "$WORK/sqlite.db" "spool_dir = \"$WORK/spool-sqlite\""
      printf '[budgets]\nstore = "memory"\n[cache]\nmode = "exact"\n' ;;
    pg)
      gateway_toml "$port" "$up" "$WORK/unused.db" "spool_dir = \"$WORK/spool-pg\"" |
        sed "s|^url = \"sqlite://.*\"|url = \"$db\"|"
      printf '[budgets]\nstore = "redis"\nredis_urls = ["redis://127.0.0.1:%s"]\n' "$redis"
      printf '[cache]\nmode = "exact"\nredis_urls = ["redis://127.0.0.1:%s"]\n' "$redis" ;;
  esac
}

# start_cost_config NAME PORT UPSTREAM_PORT REDIS_PORT PGURL: the gateway in configuration NAME
# (cost_config) on PORT, its pid in $WORK/gw-NAME.pid, tenant `bench`'s key in $WORK/NAME.key and,
# except for plain, its budgets set (bench_budgets). For pg: a Redis of its own on REDIS_PORT
# (pid in $WORK/redis.pid) and a fresh database gw_proxy_bench on the server at PGURL.
start_cost_config() {
  local name=$1 port=$2 up=$3 redis=$4 pgurl=$5
  if [ "$name" = pg ]; then
    redis-server --port "$redis" --bind 127.0.0.1 --save '' --appendonly no --dir "$WORK" >"$WORK/redis.log" 2>&1 &
    PIDS+=($!)
    echo "$!" >"$WORK/redis.pid"
    wait_port "$redis"
    psql "$pgurl/postgres" -q -c "SET client_min_messages = warning" -c 'DROP DATABASE IF EXISTS gw_proxy_bench' -c 'CREATE DATABASE gw_proxy_bench' >/dev/null
    "$BIN/gateway" migrate --database-url "$pgurl/gw_proxy_bench" >/dev/null
  fi
  cost_config "$name" "$port" "$up" "$redis" "$pgurl/gw_proxy_bench" >"$WORK/$name.toml"
  RUST_LOG=warn "$BIN/gateway" serve --config "$WORK/$name.toml" >"$WORK/$name.log" 2>&1 &
  PIDS+=($!)
  echo "$!" >"$WORK/gw-$name.pid"
  wait_port "$port"
  bench_key "http://127.0.0.1:$port" >"$WORK/$name.key"
  if [ "$name" != plain ]; then
    bench_budgets "http://127.0.0.1:$port"
  fi
}
