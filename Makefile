.PHONY: test demo services vet

# The test command: services up, gofmt, vet, go test -race ./... (scripts/test.sh).
test:
	bash scripts/test.sh

services:
	bash scripts/services.sh

vet:
	go vet ./...
