#!/usr/bin/env bash
# Checks the module layout (scripts/test.sh runs it; so does CI):
#   - the core module (root go.mod) has at most CORE_MAX modules in its
#     graph (go list -m all), none of them a broker client, an SQLite
#     driver, goose or golang-migrate: that graph is what every user's
#     build list carries;
#   - the core's packages (non-test) link no MySQL driver either;
#   - the core's go directive is not newer than CORE_GO;
#   - a sample AMQP service (scripts/testdata/amqpservice: core middleware,
#     marshaler/amqp, pgxpool) has at most SAMPLE_MAX modules and builds
#     (with -race: the build the tests then take from the cache);
#   - every go.mod of the repository is in go.work and the reverse, and every
#     module is tidy;
#   - the workspace selects the core's own versions of pgx, watermill and
#     watermill-sql, so the workspace's test run is the run against the
#     oldest versions the core declares.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/go/bin"

CORE_MAX=60
SAMPLE_MAX=65
CORE_GO=1.24.0
# Broker clients, SQLite drivers, migration tools, Redis clients.
FORBIDDEN='^(github\.com/rabbitmq/amqp091-go|github\.com/streadway/amqp|github\.com/nats-io/|github\.com/IBM/sarama|github\.com/Shopify/sarama|github\.com/segmentio/kafka-go|github\.com/twmb/franz-go|github\.com/confluentinc/|github\.com/redis/go-redis|github\.com/go-redis/|github\.com/ThreeDotsLabs/watermill-(amqp|nats|kafka|redisstream)|modernc\.org/sqlite|github\.com/mattn/go-sqlite3|github\.com/ncruces/go-sqlite3|zombiezen\.com/go/sqlite|github\.com/glebarez/|github\.com/pressly/goose|github\.com/golang-migrate/)'
MYSQL='^github\.com/go-sql-driver/mysql($|/)'

fail=0
bad() { echo "check-modules: FAIL: $*" >&2; fail=1; }

core_mods=$(GOWORK=off go list -m all)
n=$(wc -l <<<"$core_mods")
echo "check-modules: core: go list -m all: $n modules (max $CORE_MAX)"
[ "$n" -le "$CORE_MAX" ] || bad "the core's module graph has $n modules, over $CORE_MAX"
if f=$(awk '{print $1}' <<<"$core_mods" | grep -E "$FORBIDDEN"); then
  bad "the core's module graph holds $(tr '\n' ' ' <<<"$f")(go mod why -m shows the path)"
fi

deps=$(GOWORK=off go list -deps ./...)
if f=$(grep -E "$MYSQL|$FORBIDDEN" <<<"$deps"); then
  bad "the core's packages link $(tr '\n' ' ' <<<"$f")"
fi

core_go=$(sed -n 's/^go \([0-9.]*\).*/\1/p' go.mod)
if [ "$(printf '%s\n%s\n' "$core_go" "$CORE_GO" | sort -V | tail -1)" != "$CORE_GO" ]; then
  bad "the core's go directive $core_go is newer than $CORE_GO"
fi

sample=scripts/testdata/amqpservice
n=$(cd "$sample" && GOWORK=off go list -m all | wc -l)
echo "check-modules: sample AMQP service: go list -m all: $n modules (max $SAMPLE_MAX)"
[ "$n" -le "$SAMPLE_MAX" ] || bad "the sample AMQP service's module graph has $n modules, over $SAMPLE_MAX"
(cd "$sample" && GOWORK=off go build -race -o /dev/null . && GOWORK=off go mod tidy -diff >/dev/null) ||
  bad "$sample does not build or is not tidy"

work=$(bash scripts/modules.sh | sort)
found=$( (git ls-files -- 'go.mod' '*/go.mod'; find . -name go.mod -not -path './.git/*' | sed 's#^\./##') |
  grep -v '^scripts/testdata/' | sort -u | xargs -n1 dirname | sort)
[ "$work" = "$found" ] || bad "go.work lists $(tr '\n' ' ' <<<"$work")but the go.mod files are in $(tr '\n' ' ' <<<"$found")"

for m in $work; do
  (cd "$m" && GOWORK=off go mod tidy -diff >/dev/null 2>&1) || bad "module $m is not tidy (cd $m && GOWORK=off go mod tidy)"
done

for p in github.com/jackc/pgx/v5 github.com/ThreeDotsLabs/watermill github.com/ThreeDotsLabs/watermill-sql/v4; do
  own=$(GOWORK=off go list -m "$p")
  ws=$(go list -m "$p")
  [ "$own" = "$ws" ] || bad "the workspace selects $ws, the core declares $own: a module of the workspace requires a newer $p (the core's tests would not run against the core's own version)"
done

[ $fail = 0 ] && echo "check-modules: ok"
exit $fail
