package analyzer_test

import (
	"testing"

	"golang.org/x/tools/go/analysis/analysistest"

	"github.com/watermill-idempotency/idempotency/cmd/idemvet/analyzer"
)

// Each package under testdata/src holds the true positives of one rule
// (lines with a // want comment) and the code it must not report.

func TestPoolWrite(t *testing.T) {
	t.Parallel()
	analysistest.Run(t, analysistest.TestData(), analyzer.Analyzer, "poolwrite")
}

func TestTxEnd(t *testing.T) {
	t.Parallel()
	analysistest.Run(t, analysistest.TestData(), analyzer.Analyzer, "txend")
}

func TestHTTPOutsideOperation(t *testing.T) {
	t.Parallel()
	analysistest.Run(t, analysistest.TestData(), analyzer.Analyzer, "httpcall")
}

func TestReceptionID(t *testing.T) {
	t.Parallel()
	analysistest.Run(t, analysistest.TestData(), analyzer.Analyzer, "eventid")
}

func TestHandlerForms(t *testing.T) {
	t.Parallel()
	analysistest.Run(t, analysistest.TestData(), analyzer.Analyzer, "handlers")
}

func TestIgnoreDirective(t *testing.T) {
	t.Parallel()
	analysistest.Run(t, analysistest.TestData(), analyzer.Analyzer, "ignore")
}

func TestHandlerInAnotherPackage(t *testing.T) {
	t.Parallel()
	analysistest.Run(t, analysistest.TestData(), analyzer.Analyzer, "handlerpkg", "wiring")
}
