# Shared by the bench/ scripts (sourced, after `cd` to the repository root): builds the release
# binaries, makes a work directory removed on exit with every process started in PIDS, and
# starts gateways in front of the simulator.

cargo build --release -q -p gateway --bins
BIN=${CARGO_TARGET_DIR:-target}/release
WORK=$(mktemp -d)
PIDS=()
ADMIN=bench-admin-token
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  if [ -f "$WORK/nginx.pid" ]; then kill "$(cat "$WORK/nginx.pid")" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

wait_port() { for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; echo "port $1 never opened" >&2; exit 1; }

# start_gateway NAME PORT UPSTREAM_PORT EXTRA_TOML: a gateway (embedded SQLite store, ledger off,
# both tiers on the simulator at UPSTREAM_PORT serving `sim-small`, model `fast`), with tenant
# `bench` and its key in $WORK/NAME.key. EXTRA_TOML is appended to the config.
start_gateway() {
  cat >"$WORK/$1.toml" <<EOF
[server]
listen = "127.0.0.1:$2"
[store]
url = "sqlite://$WORK/$1.db"
[admin]
token = "$ADMIN"
[tiers.small]
replicas = [{ name = "sim", url = "http://127.0.0.1:$3/v1", model = "sim-small", max_concurrency = 4096 }]
[tiers.large]
replicas = [{ name = "sim-l", url = "http://127.0.0.1:$3/v1", model = "sim-small", max_concurrency = 4096 }]
[models]
fast = "small"
[prices.sim-small]
input = 0.15
output = 0.60
[ledger]
enabled = false
$4
EOF
  RUST_LOG=warn "$BIN/gateway" serve --config "$WORK/$1.toml" >"$WORK/$1.log" 2>&1 &
  PIDS+=($!)
  wait_port "$2"
  export GATEWAY_URL="http://127.0.0.1:$2" GATEWAY_ADMIN_TOKEN=$ADMIN
  "$BIN/gatewayctl" tenants create bench >/dev/null
  "$BIN/gatewayctl" --json keys create --tenant bench |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])' >"$WORK/$1.key"
}
