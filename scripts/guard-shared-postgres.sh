#!/usr/bin/env bash
# Runs a command and fails if the shared PostgreSQL server was restarted
# meanwhile: prints pg_postmaster_start_time() before and after, exits
# non-zero if it changed (or could not be read), else with the command's
# status. The tests must never restart or reconfigure a server they did not
# start (tests needing other settings start a private one:
# internal/testenv.StartPostgres).
#
#   scripts/guard-shared-postgres.sh make test
#
# DATABASE_URL selects the server (default: the tests' default).
set -uo pipefail
url=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test?sslmode=disable}
psql=$(command -v psql || echo /usr/lib/postgresql/15/bin/psql)

start_time() { "$psql" -X -A -t -q -d "$url" -c 'SELECT pg_postmaster_start_time()' 2>&1; }

before=$(start_time) || { echo "guard: cannot read pg_postmaster_start_time before the run: $before" >&2; exit 1; }
echo "guard: shared PostgreSQL pg_postmaster_start_time before: $before"
"$@"
status=$?
after=$(start_time) || { echo "guard: cannot read pg_postmaster_start_time after the run: $after" >&2; exit 1; }
echo "guard: shared PostgreSQL pg_postmaster_start_time after:  $after"
if [ "$before" != "$after" ]; then
  echo "guard: FAIL: the shared PostgreSQL server was restarted during: $*" >&2
  exit 1
fi
echo "guard: shared PostgreSQL not restarted (command status $status)"
exit $status
