#!/usr/bin/env bash
# Start the Postgres and Redis the tests use (127.0.0.1:5432, trust auth; 127.0.0.1:6379; a
# three-master Redis Cluster on 127.0.0.1:7101-7103) when they are not already running. On a
# machine without them, installs Debian's packages first.
set -euo pipefail

pg_ready() { (exec 3<>/dev/tcp/127.0.0.1/5432) 2>/dev/null; }
redis_ready() { (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; }

if ! pg_ready; then
  if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    echo "services: installing postgresql (Debian package)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    installed_pg=1
  fi
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  if [ "${installed_pg:-0}" = 1 ]; then
    # Our own fresh install: allow the tests' passwordless local TCP login.
    sed -i 's/^\(host\s\+all\s\+all\s\+127.0.0.1\/32\s\+\)\S\+/\1trust/' "/etc/postgresql/$version/main/pg_hba.conf"
  fi
  echo "services: starting postgresql $version"
  pg_ctlcluster --skip-systemctl-redirect "$version" main start
  for _ in $(seq 1 50); do pg_ready && break; sleep 0.2; done
  pg_ready || { echo "services: postgresql did not come up" >&2; exit 1; }
  su postgres -c "psql -qtAc \"SELECT 1 FROM pg_database WHERE datname='test'\" | grep -q 1 || createdb test" || true
fi

if ! redis_ready; then
  if ! command -v redis-server >/dev/null 2>&1; then
    echo "services: installing redis-server (Debian package)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  fi
  echo "services: starting redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 1 50); do redis_ready && break; sleep 0.2; done
  redis_ready || { echo "services: redis did not come up" >&2; exit 1; }
fi

# A real three-master Redis Cluster on 127.0.0.1:7101-7103 (no persistence), for the budget
# conformance suite and the multi-process test (e2e::BudgetKind::RedisCluster).
cluster_ok() { redis-cli -p 7101 cluster info 2>/dev/null | grep -q '^cluster_state:ok'; }
if ! cluster_ok; then
  echo "services: starting a 3-master redis cluster on 7101-7103"
  for port in 7101 7102 7103; do
    dir=/var/lib/redis/cluster-$port
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      rm -rf "$dir" && mkdir -p "$dir"
      redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --cluster-enabled yes \
        --cluster-config-file "$dir/nodes.conf" --cluster-node-timeout 5000 --save "" \
        --appendonly no --dir "$dir" --logfile "/var/log/redis/cluster-$port.log"
    fi
  done
  for port in 7101 7102 7103; do
    for _ in $(seq 1 50); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
  done
  # Nodes that already know a cluster but are not ok (a half-made one) start over.
  if redis-cli -p 7101 cluster info 2>/dev/null | grep -q '^cluster_known_nodes:[2-9]'; then
    for port in 7101 7102 7103; do redis-cli -p "$port" flushall >/dev/null; redis-cli -p "$port" cluster reset hard >/dev/null; done
  fi
  redis-cli --cluster create 127.0.0.1:7101 127.0.0.1:7102 127.0.0.1:7103 \
    --cluster-replicas 0 --cluster-yes >/dev/null
  for _ in $(seq 1 100); do cluster_ok && break; sleep 0.1; done
  cluster_ok || { echo "services: redis cluster did not come up" >&2; exit 1; }
fi
