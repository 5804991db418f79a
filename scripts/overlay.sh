#!/usr/bin/env bash
# Writes the `go build -overlay` file of the core module's full test run and
# prints its path. Used by scripts/test.sh; run from the repository root.
#
# The core module (the root go.mod) requires no broker client, no MySQL or
# SQLite driver, no goose, golang-migrate or Redis client: its go.mod is what
# every user's build list carries. Its tests that need one of them live next
# to the code they test, in files named _*_test.go, which the go command
# ignores (go build, go vet, go mod tidy, a plain go test). This overlay adds
# each of them under its name without the leading underscore, plus a file
# linking internal/testdeps (the MySQL and SQLite database/sql drivers) into
# internal/testenv; in the go.work workspace, the modules internal/testdeps,
# marshaler/amqp, middleware/mysqlerr and versioned/redislatest provide what
# they import. So `go test -overlay "$(bash scripts/overlay.sh)" ./...` at the
# root runs every test of the core, on every dialect.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
# One directory per checkout: the overlay names this checkout's files, and a
# run from another clone (a CI clone beside a working copy) must not
# rewrite it under a go command of this one. Files are replaced whole (mv).
dir=${TMPDIR:-/tmp}/idempotency-overlay-$(printf '%s' "$root" | cksum | cut -d' ' -f1)
mkdir -p "$dir"
cat >"$dir/testdeps_link.go.$$" <<'GO'
package testenv

import _ "github.com/watermill-idempotency/idempotency/internal/testdeps" // the MySQL and SQLite drivers
GO
mv -f "$dir/testdeps_link.go.$$" "$dir/testdeps_link.go"
{
  printf '{"Replace":{\n'
  printf '  "%s": "%s"' "$root/internal/testenv/testdeps_link.go" "$dir/testdeps_link.go"
  # Files of the core only: nested modules (a go.mod of their own) excluded.
  git ls-files -- '*/_*_test.go' | while read -r f; do
    d=$(dirname "$f")
    nested=0
    p=$d
    while [ "$p" != "." ]; do
      [ -f "$p/go.mod" ] && { nested=1; break; }
      p=$(dirname "$p")
    done
    [ $nested = 1 ] && continue
    b=$(basename "$f")
    printf ',\n  "%s": "%s"' "$root/$d/${b#_}" "$root/$f"
  done
  printf '\n}}\n'
} >"$dir/overlay.json.$$"
mv -f "$dir/overlay.json.$$" "$dir/overlay.json"
echo "$dir/overlay.json"
