#!/usr/bin/env bash
# Brings up the local services the tests need (PostgreSQL, RabbitMQ, Redis,
# MariaDB, NATS with JetStream)
# when they are installed but stopped; fails with a one-line instruction when
# one is neither running nor installed. Idempotent; safe to run repeatedly.
set -uo pipefail

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() { # name port seconds
  for _ in $(seq 1 "$3"); do port_open "$2" && return 0; sleep 1; done
  echo "services: $1 did not open 127.0.0.1:$2 within $3 s" >&2
  return 1
}

ensure() { # name port start-command install-hint wait-seconds
  local name=$1 port=$2 start=$3 hint=$4 secs=$5
  port_open "$port" && return 0
  local bin=${start%% *}
  if ! command -v "$bin" >/dev/null 2>&1; then
    echo "services: $name is not running on 127.0.0.1:$port and not installed: $hint" >&2
    return 1
  fi
  echo "services: starting $name" >&2
  bash -c "$start" >/dev/null 2>&1 || true
  wait_port "$name" "$port" "$secs"
}

ok=0
ensure PostgreSQL 5432 'pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start' \
  'apt-get install -y postgresql (then rerun)' 60 || ok=1
ensure RabbitMQ 5672 'rabbitmq-server -detached' \
  'apt-get install -y rabbitmq-server (then rerun)' 120 || ok=1
ensure Redis 6379 'redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no' \
  'apt-get install -y redis-server (then rerun)' 30 || ok=1
ensure MariaDB 3306 'start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd' \
  'apt-get install -y mariadb-server (then rerun)' 60 || ok=1
ensure "NATS (JetStream)" 4222 'start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server' \
  'apt-get install -y nats-server (then rerun)' 30 || ok=1
# This script only starts services that are down; it never restarts,
# reconfigures or adds locales to a running server (other clients share it).
exit $ok
