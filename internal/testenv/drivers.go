package testenv

import (
	"database/sql"
	"os"
	"slices"
	"testing"
)

// FullTestEnv is the environment variable scripts/test.sh sets when it runs
// the core module's tests with every test dependency linked (see
// RequireDriver). Under it a missing driver fails the test.
const FullTestEnv = "IDEMPOTENCY_FULL_TEST"

// RequireDriver skips the test when the database/sql driver is not
// registered in the test binary, or fails it when FullTestEnv is set.
//
// The core module links no MySQL or SQLite driver, not even in its tests
// (its go.mod is what every user's build list carries). The drivers are
// registered by the package internal/testdeps, a module of its own: the
// other modules' tests import it, and scripts/test.sh links it into the
// core's tests (with the files named _*_test.go, which need modules the
// core does not require) through `go test -overlay` in the workspace. A
// plain `go test ./...` in the core therefore runs the PostgreSQL targets
// and skips the MariaDB and SQLite ones, saying so.
func RequireDriver(t testing.TB, driver string) {
	t.Helper()
	if slices.Contains(sql.Drivers(), driver) {
		return
	}
	if os.Getenv(FullTestEnv) != "" {
		t.Fatalf("testenv: database/sql driver %q not registered although %s is set: the test binary lacks internal/testdeps (run scripts/test.sh)", driver, FullTestEnv)
	}
	t.Skipf("testenv: database/sql driver %q not linked into the core module's tests; scripts/test.sh runs this target (internal/testdeps)", driver)
}
