#!/bin/bash
# run.sh SQL : runs SQL in a fresh backend, prints that backend's instruction total
D=/tmp/hrow/pg
pid=$(psql -h 127.0.0.1 -p 55433 -U postgres -Atq -c "select pg_backend_pid()" -c "$1" | head -1)
for i in $(seq 1 100); do [ -s $D/cg/cg.$pid ] && grep -q '^summary' $D/cg/cg.$pid && break; sleep 0.3; done
awk '/^summary/{print $2}' $D/cg/cg.$pid
