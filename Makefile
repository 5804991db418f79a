.PHONY: test demo services vet

# The test command: services up, gofmt, vet, go test -race ./... (scripts/test.sh).
test:
	bash scripts/test.sh

services:
	bash scripts/services.sh

vet:
	go vet ./...

# The main job: the shop end to end with faults; embedded (SQLite, in-process
# broker) unless DATABASE_URL/AMQP_URL are set or -backend services is given.
demo: services
	go run ./examples/demo

# Benchmarks (bench/, results in bench/RESULTS.md): a table, then one JSON
# line. Ratios come from variants interleaved in one process. bench-quick:
# small sizes, under a minute; bench: the full sizes (1M/10M rows, 100k
# messages), long.
.PHONY: bench-quick bench
bench-quick: services
	PATH="$$PATH:/usr/local/go/bin" go run ./bench/cmd/idembench -quick

bench: services
	PATH="$$PATH:/usr/local/go/bin" go run ./bench/cmd/idembench -results bench/RESULTS.md
