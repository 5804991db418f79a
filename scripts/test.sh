#!/usr/bin/env bash
# The test command (README, `make test`, .ci/run): services up, gofmt, the
# module checks (scripts/check-modules.sh), then for EVERY module of go.work:
# go vet and go test -race against the real services (PostgreSQL, RabbitMQ,
# MariaDB, Redis, NATS; SQLite in-process). The core and the examples run
# alone, the other modules GOTEST_MODULES at a time (default 2).
#
# The core module is tested with its _*_test.go files and the MySQL and
# SQLite drivers overlaid (scripts/overlay.sh): every dialect, the brokers,
# goose and golang-migrate, while its go.mod requires none of them.
# IDEMPOTENCY_FULL_TEST makes a missing driver or store fail instead of skip.
#
# Arguments are passed to every `go test` (e.g. -run TestX). GOTEST_P sets
# -p (packages tested at once; default 2, the machine's cores);
# GOTEST_PARALLEL sets -parallel (t.Parallel tests run at once in a package;
# default 4: most of them wait on a server, a broker or a fault's timer, not
# on a core).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/go/bin"
export IDEMPOTENCY_FULL_TEST=1
p=${GOTEST_P:-2}
par=${GOTEST_PARALLEL:-4}

bash scripts/services.sh
# The pooler tests also run against PgBouncer 1.24 (the machine's package is
# 1.18): built once by scripts/pgbouncer-newer.sh (cached under /var/tmp),
# unless the caller names one. A build that fails leaves it unset, and those
# tests then say why (under CI=true they fail).
export IDEMPOTENCY_PGBOUNCER_NEWER=${IDEMPOTENCY_PGBOUNCER_NEWER:-$(bash scripts/pgbouncer-newer.sh || true)}
files=$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')
unformatted=$(gofmt -l $files)
test -z "$unformatted" || { echo "gofmt: files need formatting:"; echo "$unformatted"; exit 1; }
bash scripts/check-modules.sh

overlay=$(bash scripts/overlay.sh)
status=0
# test_module DIR [go test flags]: go vet and go test -race of one module.
# go vet takes -race too, so that the dependencies it compiles (for their
# export data) are the race-instrumented ones go test links next, from the
# build cache, instead of a second, uninstrumented build of each (the SQLite
# driver alone is 40 s of a cold build); go test's own vet pass is off (the
# whole of go vet just ran).
test_module() {
  local m=$1 start=$SECONDS
  shift
  local flags=()
  [ "$m" = . ] && flags=(-overlay "$overlay")
  echo "=== module $m"
  local rc=0
  (cd "$m" && go vet -race "${flags[@]}" ./... && go test "${flags[@]}" -race -vet=off -count=1 -p "$p" -parallel "$par" -timeout 9m "$@" ./...) || rc=1
  echo "=== module $m: $((SECONDS - start)) s"
  return $rc
}

# The core and the examples (the demo runs its services' consumers, up to
# 50 PostgreSQL sessions) run alone; the other modules, smaller and mostly
# waiting on a broker, a link or a child process, run GOTEST_MODULES at a
# time (default 2), each one's output printed whole when it ends.
lanes=${GOTEST_MODULES:-2}
# The longest of them (the end-to-end tests, Kafka's consumer groups) start
# first, so that no lane ends long after the other.
first=() rest=()
for m in $(bash scripts/modules.sh); do
  case $m in
  . | examples) test_module "$m" "$@" || status=1 ;;
  e2e | marshaler/kafka/kfaketest) first+=("$m") ;;
  *) rest+=("$m") ;;
  esac
done
rest=("${first[@]}" "${rest[@]}")
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
running=0
for i in "${!rest[@]}"; do
  if [ "$running" -ge "$lanes" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  (
    if test_module "${rest[$i]}" "$@" >"$logs/$i.log" 2>&1; then :; else touch "$logs/$i.failed"; fi
    cat "$logs/$i.log"
  ) &
  running=$((running + 1))
done
wait
for i in "${!rest[@]}"; do
  [ -e "$logs/$i.failed" ] && status=1
done

# Allocation-count tests are not built under the race detector (it
# allocates on its own): vet their file and run them once without it. They
# need neither the overlay's files nor its drivers.
echo "=== allocation counts (no race detector)"
(go vet ./internal/inbox/ && go test -count=1 -run 'Allocate' ./internal/inbox/) || status=1

# The examples are what users copy: idemvet (cmd/idemvet) must find nothing
# in them that voids the guarantee.
echo "=== idemvet on examples"
vettool=$(mktemp -d)/idemvet
(cd cmd/idemvet && go build -o "$vettool" .) && (cd examples && go vet -race -vettool="$vettool" ./...) || status=1
exit $status
