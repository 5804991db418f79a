.PHONY: test demo services vet check-modules compat

# The test command: services up, gofmt, the module checks, go vet and
# go test -race of every module of go.work (scripts/test.sh).
test:
	bash scripts/test.sh

services:
	bash scripts/services.sh

# go vet of every module; the core with its _*_test.go files (scripts/overlay.sh).
vet:
	@for m in $$(bash scripts/modules.sh); do \
	  if [ "$$m" = . ]; then go vet -overlay "$$(bash scripts/overlay.sh)" ./... || exit 1; \
	  else (cd "$$m" && go vet ./...) || exit 1; fi; \
	done

# The core's module graph, links and go directive (scripts/check-modules.sh).
check-modules:
	bash scripts/check-modules.sh

# The core alone against its declared and the newest pgx/watermill/watermill-sql.
compat:
	bash scripts/compat.sh all

# The main job: the shop end to end with faults; embedded (SQLite, in-process
# broker) unless DATABASE_URL/AMQP_URL are set or -backend services is given.
demo: services
	go run ./examples/demo

# Benchmarks (bench/, results in bench/RESULTS.md): a table, then one JSON
# line. Ratios come from variants interleaved in one process. bench-quick:
# small sizes (a minute, plus the counts part under valgrind); bench: the
# full sizes (1M/10M rows, 100k messages), long. Both only check that the
# services they use are reachable (bench-services): they never start,
# restart or reconfigure one (other clients share them; `make services`
# starts the stopped ones).
.PHONY: bench-quick bench bench-services
bench-services:
	@bash -c 'for s in PostgreSQL:5432 RabbitMQ:5672 NATS:4222; do \
	  (exec 3<>/dev/tcp/127.0.0.1/$${s#*:}) 2>/dev/null || \
	  { echo "bench: $${s%%:*} is not reachable on 127.0.0.1:$${s#*:} (make services starts it)" >&2; exit 1; }; \
	done'

bench-quick: bench-services
	PATH="$$PATH:/usr/local/go/bin" go run ./bench/cmd/idembench -quick

bench: bench-services
	PATH="$$PATH:/usr/local/go/bin" go run ./bench/cmd/idembench -results bench/RESULTS.md
