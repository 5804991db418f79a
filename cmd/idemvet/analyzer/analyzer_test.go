package analyzer_test

import (
	"testing"

	"golang.org/x/tools/go/analysis/analysistest"

	"github.com/watermill-idempotency/idempotency/cmd/idemvet/analyzer"
)

// TestRules runs the analyzer on the packages under testdata/src, each
// holding the true positives of one concern (the lines with a // want
// comment) and the code it must not report:
//
//	poolwrite            rule pool-write
//	txend                rule tx-end
//	eventid              rule reception-id
//	httpcall             rule http-outside-op
//	handlers             which functions are handlers, the one-level follow,
//	                     code that runs without an attempt
//	handlerpkg, wiring   a handler declared in one package, attached in another
//	ignore               //idemvet:ignore <reason>
//
// One run loads the standard library's sources once for all of them.
func TestRules(t *testing.T) {
	t.Parallel()
	analysistest.Run(t, analysistest.TestData(), analyzer.Analyzer,
		"poolwrite", "txend", "eventid", "httpcall", "handlers", "handlerpkg", "wiring", "ignore")
}
