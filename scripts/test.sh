#!/usr/bin/env bash
# The test command (README, `make test`, .ci/run): services up, then the whole
# suite with the race detector against the real PostgreSQL and RabbitMQ.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/go/bin"
bash scripts/services.sh
test -z "$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))" || { echo "gofmt: files need formatting:"; gofmt -l .; exit 1; }
go vet ./...
exec go test -race -count=1 -timeout 9m "$@" ./...
