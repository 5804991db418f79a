// Package crashpoint names the places where crash tests kill a process. The
// library calls Reached at each named point; outside tests no hook is set and
// Reached only loads a nil pointer. A test's child process sets a hook (for
// example one that SIGKILLs itself at "after-commit"), so crashes happen at an
// exact point, not after a sleep and a hope.
package crashpoint

import "sync/atomic"

// Named points.
const (
	// AfterClaim: the claim is in the transaction, the handler has not run.
	AfterClaim = "after-claim"
	// BeforeCommit: the handler returned nil, COMMIT not yet sent.
	BeforeCommit = "before-commit"
	// AfterCommit: COMMIT succeeded; the router has not acked (nor published
	// returned messages) yet.
	AfterCommit = "after-commit"
	// OutboxAfterPublish: the outbox relay published a round's rows (the
	// broker confirmed them) and has not yet deleted them.
	OutboxAfterPublish = "outbox-after-publish"
	// MigrationStatementApplied: on MySQL or SQLite, one statement of a
	// migration committed, the version is not recorded yet.
	MigrationStatementApplied = "migration-statement-applied"
)

var hook atomic.Pointer[func(name string)]

// Set installs f as the hook (nil removes it). Tests only.
func Set(f func(name string)) {
	if f == nil {
		hook.Store(nil)
		return
	}
	hook.Store(&f)
}

// Reached reports that the process is at the named point.
func Reached(name string) {
	if f := hook.Load(); f != nil {
		(*f)(name)
	}
}
