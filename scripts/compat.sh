#!/usr/bin/env bash
# Tests the core module alone (GOWORK=off, its go.mod as users get it)
# against two sets of dependency versions (CI runs both after make test):
#
#   declared  the core's go.mod as is: the oldest versions it declares;
#   latest    pgx/v5, watermill and watermill-sql/v4 at the newest versions
#             the module proxy serves (go get -modfile on a copy of go.mod
#             and go.sum in a temporary directory; the repository's files
#             are not touched).
#
# Each vets the core's packages and their tests (go vet: type-checked
# against those versions, nothing linked), and runs the tests of
# COMPAT_PACKAGES (default the pgx adapter, internal/sqldb; ./... for all),
# without the race detector: make test ran them at
# the workspace's versions, and this run checks the API and the adapter's
# behaviour against other versions. Without the
# workspace the _*_test.go files and the MySQL/SQLite drivers are not
# linked: the PostgreSQL targets run, the MariaDB and SQLite ones skip
# (make test runs them, at the declared versions: check-modules.sh ensures
# the workspace selects the core's own pgx, watermill and watermill-sql).
#
#   scripts/compat.sh [declared|latest|all] [go test flags]
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/go/bin"
export GOWORK=off
unset IDEMPOTENCY_FULL_TEST
which=${1:-all}
[ $# -gt 0 ] && shift
p=${GOTEST_P:-2}
# internal/sqldb's pooler tests run against PgBouncer 1.24 too, as in make
# test (scripts/pgbouncer-newer.sh: built once, cached; a failed build leaves
# it empty and those tests say why).
export IDEMPOTENCY_PGBOUNCER_NEWER=${IDEMPOTENCY_PGBOUNCER_NEWER:-$(bash scripts/pgbouncer-newer.sh || true)}

run() { # label, then go flags
  local label=$1
  shift
  echo "=== compat: $label: $(go list "$@" -m github.com/jackc/pgx/v5 github.com/ThreeDotsLabs/watermill github.com/ThreeDotsLabs/watermill-sql/v4 | tr '\n' ' ')"
  # Every package and test file type-checks against these versions (go vet
  # compiles the dependencies and checks ours; no test binary is linked)...
  go vet "$@" ./...
  # ...and the tests of COMPAT_PACKAGES run: by default the pgx adapter
  # (internal/sqldb: exec modes, poolers, errors), where a new pgx changes
  # behaviour; COMPAT_PACKAGES=./... runs every package (about 2 more
  # minutes, past CI's budget).
  # shellcheck disable=SC2086
  go test "$@" -count=1 -p "$p" -parallel "${GOTEST_PARALLEL:-4}" -timeout 9m "${extra[@]}" ${COMPAT_PACKAGES:-./internal/sqldb/}
}

extra=("$@")
mods=(github.com/jackc/pgx/v5 github.com/ThreeDotsLabs/watermill github.com/ThreeDotsLabs/watermill-sql/v4)
case $which in
declared) run declared ;;
all)
  # make test already ran the core (overlay included) at the workspace's
  # versions; when go.work selects exactly the versions go.mod declares,
  # that run was the declared one.
  if [ "$(go list -m "${mods[@]}")" = "$(env -u GOWORK go list -m "${mods[@]}")" ]; then
    echo "=== compat: declared: $(go list -m "${mods[@]}" | tr '\n' ' ')= the workspace's versions, tested by make test"
  else
    run declared
  fi
  ;;
esac
case $which in
latest | all)
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  cp go.mod "$tmp/go.mod"
  cp go.sum "$tmp/go.sum"
  go get -modfile="$tmp/go.mod" github.com/jackc/pgx/v5@latest github.com/ThreeDotsLabs/watermill@latest github.com/ThreeDotsLabs/watermill-sql/v4@latest
  run latest -modfile="$tmp/go.mod"
  ;;
esac
