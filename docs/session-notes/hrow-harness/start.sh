#!/bin/bash
# scratch PostgreSQL under cachegrind on port 55433 (hrow's harness)
set -e
D=/tmp/hrow/pg
rm -rf $D/data $D/cg; mkdir -p $D/cg; chown -R postgres $D
su postgres -c "initdb -D $D/data -U postgres --auth=trust --no-sync --no-instructions --encoding=UTF8 --locale=C" >/dev/null
su postgres -c "nohup valgrind --tool=cachegrind --cache-sim=no --trace-children=no --cachegrind-out-file=$D/cg/cg.%p postgres -D $D/data -c port=55433 -c listen_addresses=127.0.0.1 -c unix_socket_directories= -c fsync=off -c max_connections=20 -c shared_buffers=64MB -c autovacuum=off -c max_parallel_workers_per_gather=0 > $D/log 2>&1 &"
for i in $(seq 1 120); do pg_isready -h 127.0.0.1 -p 55433 -q && exit 0; sleep 1; done; exit 1
