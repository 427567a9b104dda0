#!/usr/bin/env bash
# Start the Postgres and Redis the tests use (127.0.0.1:5432, trust auth; 127.0.0.1:6379) when
# they are not already running. On a machine without them, installs Debian's packages first.
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
