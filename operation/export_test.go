package operation

import (
	"time"

	"github.com/watermill-idempotency/idempotency/internal/sqldb"
)

// Test-only exports for the external test package.

const (
	CrashAfterBegin = crashAfterBegin
	CrashAfterCall  = crashAfterCall
)

// PgLockKey is the SQL expression of a key's advisory lock number
// (PostgreSQL): $1 the key, $2 the quoted table.
const PgLockKey = pgLockKey

// ProcessLockWaiters is the number of attempts of this process waiting for
// k's lock (SQLite) on the database file and table.
func ProcessLockWaiters(file, table string, k Key) int {
	_, name := processLockTable(table)
	return processLockWaiters(processLockName(file, name, k.String()))
}

// DialectOf is the runner's SQL dialect.
func DialectOf(r *Runner) sqldb.Dialect { return r.dialectOf() }

// The tests' lease: short, so that a dead owner's record is judged soon.
func init() { leaseDuration, acquireTimeout = 3*time.Second, 2*time.Second }

// LeaseDuration is the lease of a started record's owner in these tests.
func LeaseDuration() time.Duration { return leaseDuration }

// AcquireTimeout bounds Do's wait for a connection in these tests.
func AcquireTimeout() time.Duration { return acquireTimeout }
