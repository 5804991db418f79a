// Command idemvet reports effects that escape the transaction of a
// watermill-idempotency consumer: writes through a pool in a handler, a
// handler ending the attempt's transaction, event ids minted at reception,
// and HTTP calls outside an operation key. The rules are documented in
// package analyzer.
//
// Run it through go vet:
//
//	go install github.com/watermill-idempotency/idempotency/cmd/idemvet@latest
//	go vet -vettool=$(which idemvet) ./...
//
// or on its own: idemvet ./...
package main

import (
	"golang.org/x/tools/go/analysis/singlechecker"

	"github.com/watermill-idempotency/idempotency/cmd/idemvet/analyzer"
)

func main() { singlechecker.Main(analyzer.Analyzer) }
